"""Metric states that merge exactly across batches, devices and hosts.

Every metric is an immutable pytree (``flax.struct.dataclass``):

    Metric.empty(**static_options) -> Metric        # zero state; options are pytree_node=False
    metric.update(**batch) -> Metric                # adds one batch; unused batch keys are ignored
    metric.merge(other) -> Metric                   # exact and associative
    metric.compute() -> float | dict[str, float]    # host side, python floats

Batch keys: ``logits`` [..., C] (or integer ``preds`` [...]) and ``labels`` [...] for
classification; float ``preds`` and ``labels`` for regression; ``loss`` (or ``values``) for
averages; ``scores`` for AUROC; ``mask`` (optional, bool or float, shape a prefix of
``labels``: [B] or [B, T]; 0 = padding). Padded entries are removed with ``where``, never by
multiplying, so NaN / inf / out-of-range garbage in padded rows cannot leak. Every metric reads
a float mask as the entry's weight (its value where > 0, else 0; a bool mask weighs 0 / 1), as
scikit-learn's ``sample_weight``: accuracies are weighted shares, confusion-matrix entries
summed weights (precision / recall / F1 follow from them), AUROC the weighted share of
(positive, negative) pairs ranked right, MSE / MAE / R2 / Pearson weighted moments, Spearman
the weighted Pearson correlation of weighted midranks (an entry of weight w counting as w
copies).

Jittable: ``update`` works inside ``jax.jit`` (also on sharded batches) and the state is a
fixed-shape pytree: Average, Loss, Perplexity, BitsPerByte, Accuracy, TopKAccuracy,
ConfusionMatrix, PrecisionRecallF1, MSE, MAE, R2, Pearson (class attribute ``JITTABLE``).
Host-side: AUROC and Spearman need every (score, label) pair; their ``update`` takes fetched
arrays outside jit, drops padded entries, and appends to numpy buffers. They are exact, and
raise once more than ``max_examples`` valid entries are held (no approximation).

Precision. On device one batch contributes float32 sums (XLA's reductions:
~5e-8 relative error for 1M float32 values on CPU). ``merge`` outside jit turns leaves into
numpy float64, and ``update`` outside jit is ``merge(state_of_batch)``, so accumulation
across batches and hosts is float64. Second moments (R2, Pearson) are centred per batch and
merged with Chan et al.'s parallel formula, which avoids the cancellation of sum-of-squares
formulas. The exact pattern for an eval loop:

    step = jax.jit(lambda batch: template.update(**batch))   # one batch's state, float32
    total = template
    for batch in batches:
        total = total.merge(step(batch))                      # float64 on the host

Carrying the state through jit (``jit(lambda m, b: m.update(**b))``) accumulates in float32.
Metrics are immutable, so an ``empty()`` template can be reused for every evaluation.

Layout: ``averages``, ``classification``, ``regression``, ``gathered`` (host-side),
``collection`` (MetricCollection, reduce_across_processes) and ``tasks`` (which metrics an
evaluation computes, by name or by task, and how jtrain's batches feed them); ``base``
holds what they share (host dtypes, exact merging, masks); ``names`` lists every metric
name a run writes (train/*, eval/*, perf/*, startup/*, compile/*).
"""

from jtrain.metrics.averages import Average, BitsPerByte, Loss, Perplexity
from jtrain.metrics.classification import (Accuracy, ConfusionMatrix, PrecisionRecallF1,
                                           TopKAccuracy)
from jtrain.metrics.collection import MetricCollection, reduce_across_processes
from jtrain.metrics.gathered import AUROC, Spearman
from jtrain.metrics.regression import MAE, MSE, R2, Moments, Pearson
from jtrain.metrics.tasks import (EvalSpec, default_names, infer_task, make_collection,
                                  metric_batch, update_from_outputs)

__all__ = [
    "AUROC", "Accuracy", "Average", "BitsPerByte", "ConfusionMatrix", "EvalSpec", "Loss",
    "MAE", "MSE", "MetricCollection", "Moments", "Pearson", "Perplexity",
    "PrecisionRecallF1", "R2", "Spearman", "TopKAccuracy", "default_names", "infer_task",
    "make_collection", "metric_batch", "reduce_across_processes", "update_from_outputs",
]
