"""Metric states that merge exactly across batches, devices and hosts
(docs/guide/evaluation.md).

Every metric is an immutable pytree (``flax.struct.dataclass``):

    Metric.empty(**static_options) -> Metric        # zero state; options are pytree_node=False
    metric.update(**batch) -> Metric                # adds one batch; unused batch keys are ignored
    metric.merge(other) -> Metric                   # exact and associative
    metric.compute() -> float | dict[str, float]    # host side, python floats

Batch keys: ``logits`` (or integer ``preds``) and ``labels``; float ``preds`` for
regression; ``loss`` (or ``values``) for averages; ``scores`` for AUROC; an optional
``mask`` (a prefix of ``labels``' shape; 0 = padding, a float is the entry's weight, as
scikit-learn's ``sample_weight``). Padded entries are removed with ``where``, never by
multiplying, so garbage in padded rows cannot leak. ``update`` works inside ``jax.jit``
(class attribute ``JITTABLE``) except for AUROC and Spearman, which hold every valid
pair in numpy buffers (exact, up to ``max_examples``). One batch sums in float32 on
device; ``merge`` outside jit is float64 (second moments merged with Chan et al.'s
formula), so an eval loop merges each batch's jitted state on the host:

    step = jax.jit(lambda batch: template.update(**batch))   # one batch's state, float32
    total = template
    for batch in batches:
        total = total.merge(step(batch))                      # float64 on the host

Modules: averages, classification, regression, gathered (host-side), collection
(MetricCollection, reduce_across_processes), tasks (which metrics an evaluation
computes), base (what they share), names (every metric name a run writes).
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
