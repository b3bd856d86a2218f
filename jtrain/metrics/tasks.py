"""Which metrics an evaluation computes, and how jtrain's batches feed them.

The task comes from shapes known before anything runs (the model's output shape from
`jax.eval_shape`, the targets' shape and dtype from the first example):

  classification  int targets [B], outputs [B, C]          (one label per example)
  sequence        int targets [B, T...], outputs [B, T..., V]  (language models, tagging)
  regression      float targets, outputs with as many values per example
  other           anything else (e.g. a user loss on custom outputs): loss only

`eval.metrics` names the metrics; empty means the task's defaults (`default_names`).
Loss, perplexity and bits per byte come from the loss function's exact (sum, weight);
the others read ``logits`` / ``preds``, ``labels`` and ``mask`` built by `metric_batch`
from the model outputs and the batch (``targets``, ``weights`` x ``mask``).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jtrain import losses
from jtrain.config import METRIC_NAMES  # noqa: F401  (declared in the schema; re-exported)
from jtrain.errors import ConfigError
from jtrain.metrics.averages import Average, BitsPerByte, Loss, Perplexity
from jtrain.metrics.classification import (Accuracy, ConfusionMatrix, PrecisionRecallF1,
                                           TopKAccuracy)
from jtrain.metrics.collection import MetricCollection
from jtrain.metrics.gathered import AUROC, Spearman
from jtrain.metrics.regression import MAE, MSE, R2, Pearson

_CLASS_NAMES = {"loss", "accuracy", "top_k_accuracy", "precision_recall_f1", "confusion_matrix",
                "auroc", "perplexity", "bits_per_byte"}
_ALLOWED = {"classification": _CLASS_NAMES, "sequence": _CLASS_NAMES,
            "regression": {"loss", "mse", "mae", "r2", "pearson", "spearman"},
            "other": {"loss"}}
# Defaults stay cheap: per-class scalars, a confusion matrix and AUROC only for few classes.
_MAX_DEFAULT_CLASSES = 100
_MAX_PER_CLASS = 10


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """What an evaluation computes; static (hashable), decided before the step compiles.

    Attributes:
        task: "classification", "sequence", "regression" or "other".
        names: the metrics computed, from `eval.metrics`'s choices.
        num_classes: classification / sequence: the size of the last output axis.
        top_k: the k of top_k_accuracy.
        max_gathered: how many examples AUROC and Spearman keep at most.
        num_outputs: regression: the outputs r2 scores apart (the targets' last axis).

    Examples:
        ```python
        import jax.numpy as jnp
        import numpy as np
        from jtrain import metrics

        spec = metrics.EvalSpec.create((3,), (), np.int32)   # [3] logits, int labels
        spec.task, spec.names     # 'classification', ('loss', 'accuracy', 'precision_recall_f1',
                                  #   'confusion_matrix', 'auroc')
        ```
    """
    task: str                       # classification | sequence | regression | other
    names: tuple[str, ...]          # from METRIC_NAMES
    num_classes: int = 0            # classification / sequence: size of the last output axis
    top_k: int = 5
    max_gathered: int = 1_000_000   # AUROC / Spearman keep at most this many examples
    num_outputs: int = 1            # regression: outputs r2 scores apart (targets' last axis)

    @classmethod
    def create(cls, output_shape, targets_shape, targets_dtype, *, names=(), top_k: int = 5,
               max_gathered: int = 1_000_000, byte_level: bool = False) -> EvalSpec:
        """The spec for these shapes (no batch axis); `names` empty = the task's defaults.
        Raises ConfigError (key eval.metrics) for a metric the task cannot compute."""
        task, num_classes = infer_task(output_shape, targets_shape, targets_dtype)
        names = tuple(dict.fromkeys(names)) or default_names(task, num_classes, top_k=top_k,
                                                              byte_level=byte_level)
        bad = [n for n in names if n not in _ALLOWED[task]]
        if bad:
            raise ConfigError("eval.metrics", f"{', '.join(bad)} cannot be computed for this "
                              f"run's {task} outputs (outputs {tuple(output_shape or ())}, "
                              f"targets {tuple(targets_shape)} {np.dtype(targets_dtype).name});"
                              f" choose from {', '.join(sorted(_ALLOWED[task]))}")
        # Regression targets [..., k] per example are k outputs (scikit-learn's columns),
        # scalar targets one: r2 averages the outputs' R² as r2_score does by default.
        num_outputs = int(targets_shape[-1]) if task == "regression" and len(
            targets_shape) else 1
        return cls(task=task, names=names, num_classes=num_classes, top_k=top_k,
                   max_gathered=max_gathered, num_outputs=num_outputs)

    @property
    def gathers(self) -> bool:
        """True when host-side metrics need the batch's predictions fetched."""
        return any(n in ("auroc", "spearman") for n in self.names)


def infer_task(output_shape, targets_shape, targets_dtype) -> tuple[str, int]:
    """(task, num_classes) from per-example shapes (no batch axis); see the module doc.

    Examples:
        ```python
        import jax.numpy as jnp
        import numpy as np
        from jtrain import metrics

        metrics.infer_task((3,), (), np.int32)           # ('classification', 3)
        metrics.infer_task((8, 256), (8,), np.int32)     # ('sequence', 256)
        metrics.infer_task((1,), (1,), np.float32)       # ('regression', 0)
        ```
    """
    if output_shape is None:
        return "other", 0
    out, tgt = tuple(output_shape), tuple(targets_shape)
    if np.issubdtype(np.dtype(targets_dtype), np.integer):
        if len(out) == len(tgt) + 1 and out[:-1] == tgt and out[-1] >= 2:
            return ("classification" if not tgt else "sequence"), int(out[-1])
        return "other", 0
    if np.issubdtype(np.dtype(targets_dtype), np.floating) and \
            int(np.prod(out)) == int(np.prod(tgt)):
        return "regression", 0
    return "other", 0


def default_names(task: str, num_classes: int = 0, *, top_k: int = 5,
                  byte_level: bool = False) -> tuple[str, ...]:
    """The metrics an evaluation computes for `task` when `eval.metrics` names none.

    Examples:
        ```python
        import jax.numpy as jnp
        import numpy as np
        from jtrain import metrics

        metrics.default_names("classification", 3)
        # ('loss', 'accuracy', 'precision_recall_f1', 'confusion_matrix', 'auroc')
        metrics.default_names("regression")
        # ('loss', 'mse', 'mae', 'r2', 'pearson', 'spearman')
        ```
    """
    if task == "classification":
        names = ["loss", "accuracy"]
        if num_classes > top_k:
            names.append("top_k_accuracy")
        names.append("precision_recall_f1")
        if num_classes <= _MAX_DEFAULT_CLASSES:
            names += ["confusion_matrix", "auroc"]
        return tuple(names)
    if task == "sequence":
        return ("loss", "accuracy", "perplexity") + (("bits_per_byte",) if byte_level else ())
    if task == "regression":
        return ("loss", "mse", "mae", "r2", "pearson", "spearman")
    return ("loss",)


def make_collection(spec: EvalSpec) -> MetricCollection:
    """The empty metric states for `spec`, keyed by the names they report under.

    Examples:
        ```python
        import jax.numpy as jnp
        import numpy as np
        from jtrain import metrics

        spec = metrics.EvalSpec.create((3,), (), np.int32)
        logits, batch = jnp.zeros((4, 3)), {"targets": jnp.array([0, 1, 1, 0])}
        list(metrics.make_collection(spec).metrics)
        # ['loss', 'accuracy', 'precision_recall_f1', 'confusion_matrix', 'auroc']
        ```
    """
    c = spec.num_classes
    build = {
        "loss": lambda: ("loss", Loss.empty()),
        "perplexity": lambda: ("perplexity", Perplexity.empty()),
        "bits_per_byte": lambda: ("bits_per_byte", BitsPerByte.empty()),
        "accuracy": lambda: ("accuracy", Accuracy.empty()),
        "top_k_accuracy": lambda: (f"top_{spec.top_k}_accuracy", TopKAccuracy.empty(k=spec.top_k)),
        "precision_recall_f1": lambda: ("precision_recall_f1", PrecisionRecallF1.empty(
            c, per_class=c <= _MAX_PER_CLASS)),
        "confusion_matrix": lambda: ("confusion_matrix", ConfusionMatrix.empty(c)),
        "auroc": lambda: ("auroc", AUROC.empty(c, max_examples=spec.max_gathered)),
        "mse": lambda: ("mse", MSE.empty()),
        "mae": lambda: ("mae", MAE.empty()),
        "r2": lambda: ("r2", R2.empty(spec.num_outputs)),
        "pearson": lambda: ("pearson", Pearson.empty()),
        "spearman": lambda: ("spearman", Spearman.empty(max_examples=spec.max_gathered)),
    }
    return MetricCollection.empty(dict(build[n]() for n in spec.names))


def metric_batch(outputs, batch: dict, spec: EvalSpec) -> dict:
    """The metric keys (logits or preds, labels, mask) for jtrain's batch conventions.

    The mask is `weights` x row `mask` (an LM's loss mask drops padding tokens); every
    metric weighs an entry by its mask (padding rows weigh 0).

    Examples:
        ```python
        import jax.numpy as jnp
        import numpy as np
        from jtrain import metrics

        spec = metrics.EvalSpec.create((3,), (), np.int32)
        logits, batch = jnp.zeros((4, 3)), {"targets": jnp.array([0, 1, 1, 0])}
        metrics.metric_batch(logits, batch, spec).keys()   # logits, labels, mask
        ```
    """
    if spec.task in ("classification", "sequence"):
        labels = batch["targets"]
        return {"logits": outputs, "labels": labels,
                "mask": losses.weights_for(batch, labels.shape)}
    if spec.task == "regression":
        labels = jnp.asarray(batch["targets"], jnp.float32)
        preds = jnp.asarray(outputs, jnp.float32).reshape(labels.shape)
        return {"preds": preds, "labels": labels, "mask": losses.weights_for(batch, labels.shape)}
    return {}


def update_from_outputs(collection: MetricCollection, outputs, batch: dict, loss_sum, weight,
                        spec: EvalSpec) -> MetricCollection:
    """`collection` plus one batch. Jittable for jittable collections.

    Averages (loss, perplexity, bits per byte) take the loss function's exact
    (loss_sum, weight); every other metric reads `metric_batch`.

    Examples:
        ```python
        import jax.numpy as jnp
        import numpy as np
        from jtrain import metrics

        spec = metrics.EvalSpec.create((3,), (), np.int32)
        logits, batch = jnp.zeros((4, 3)), {"targets": jnp.array([0, 1, 1, 0])}
        collection = metrics.make_collection(spec)
        loss_sum, weight = jnp.float32(2.0), jnp.float32(4.0)   # the loss function's
        collection = metrics.update_from_outputs(collection, logits, batch, loss_sum, weight, spec)
        collection.compute()["loss"]                             # 0.5
        ```
    """
    inputs = metric_batch(outputs, batch, spec)
    new = {}
    for name, metric in collection.metrics.items():
        if isinstance(metric, Average):
            new[name] = metric.merge(metric.replace(total=jnp.asarray(loss_sum, jnp.float32),
                                                    count=jnp.asarray(weight, jnp.float32)))
        else:
            new[name] = metric.update(**inputs)
    return collection.replace(metrics=new)
