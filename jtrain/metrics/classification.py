"""Classification: accuracy, top-k accuracy, confusion matrix, precision / recall / F1."""

from __future__ import annotations

from typing import ClassVar

import jax.numpy as jnp
import numpy as np
from flax import struct

from jtrain.metrics.base import (Array, check_mergeable, class_predictions, entry_weights,
                                 ratio, require, sum_merge, to_host, weighted_sum, zeros)


@struct.dataclass
class Accuracy:
    """argmax(logits, -1) == labels (or integer ``preds`` == labels), token level for [B, T],
    each entry weighing its mask (sklearn's accuracy_score with sample_weight).

    Attributes:
        correct: the summed weight of the entries whose prediction is the label.
        count: the summed weight of the entries (a mask entry weighs its value if > 0, else 0).

    Examples:
        ```python
        import jax.numpy as jnp
        from jtrain import metrics

        logits = jnp.array([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0], [1.0, 2.0, 0.0]])
        labels = jnp.array([0, 1, 1, 0])
        metrics.Accuracy.empty().update(logits=logits, labels=labels).compute()   # 0.5
        ```
    """
    correct: Array  # float32 on device, float64 merged
    count: Array    # float32 on device, float64 merged
    JITTABLE: ClassVar[bool] = True

    @classmethod
    def empty(cls):
        return cls(correct=zeros(np.float32), count=zeros(np.float32))

    def update(self, **batch):
        labels = jnp.asarray(require(batch, "labels", self))
        w = entry_weights(batch.get("mask"), labels.shape)
        hit = class_predictions(batch, self) == labels
        return self.merge(self.replace(correct=weighted_sum(hit, w),
                                       count=jnp.sum(w, dtype=jnp.float32)))

    def merge(self, other):
        return sum_merge(self, other)

    def compute(self) -> float:
        return ratio(self.correct, self.count)


@struct.dataclass
class TopKAccuracy:
    """The label's logit is among the k largest (ties count as hits); needs ``logits``.
    Each entry weighs its mask (sklearn's top_k_accuracy_score with sample_weight).

    Attributes:
        correct: the summed weight of the entries whose label is among the k largest logits.
        count: the summed weight of the entries (a mask entry weighs its value if > 0).
        k: how many of the largest logits count (static).

    Examples:
        ```python
        import jax.numpy as jnp
        from jtrain import metrics

        logits = jnp.array([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0], [1.0, 2.0, 0.0]])
        labels = jnp.array([0, 1, 1, 0])
        metrics.TopKAccuracy.empty(k=2).update(logits=logits, labels=labels).compute()  # 1.0
        ```
    """
    correct: Array
    count: Array
    k: int = struct.field(pytree_node=False, default=5)
    JITTABLE: ClassVar[bool] = True

    @classmethod
    def empty(cls, k: int = 5):
        if k < 1:
            raise ValueError(f"TopKAccuracy: k must be >= 1, got {k}")
        return cls(correct=zeros(np.float32), count=zeros(np.float32), k=k)

    def update(self, **batch):
        logits = jnp.asarray(require(batch, "logits", self))   # [..., C]
        labels = jnp.asarray(require(batch, "labels", self))   # [...]
        num_classes = logits.shape[-1]
        w = entry_weights(batch.get("mask"), labels.shape)
        in_range = (labels >= 0) & (labels < num_classes)
        safe = jnp.where((w > 0) & in_range, labels, 0)
        label_logit = jnp.take_along_axis(logits, safe[..., None], axis=-1)  # [..., 1]
        rank = jnp.sum(logits > label_logit, axis=-1)                         # [...]
        hit = in_range & (rank < self.k)
        return self.merge(self.replace(correct=weighted_sum(hit, w),
                                       count=jnp.sum(w, dtype=jnp.float32)))

    def merge(self, other):
        return sum_merge(self, other)

    def compute(self) -> float:
        return ratio(self.correct, self.count)


@struct.dataclass
class ConfusionMatrix:
    """counts[true, predicted] (sklearn's layout), from ``logits`` or integer ``preds``.

    Each entry adds its weight (its mask's value if > 0, else nothing): the entries are
    weighted sums, as sklearn's confusion_matrix with sample_weight (counts when every
    weight is 1). Entries whose label or prediction lies outside [0, num_classes) are not
    counted. compute() -> float64 array [C, C] (not a scalar: use PrecisionRecallF1 in a
    collection).

    Attributes:
        counts: float [C, C], counts[true, predicted], summed weights.
        num_classes: C (static).

    Examples:
        ```python
        import jax.numpy as jnp
        from jtrain import metrics

        logits = jnp.array([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0], [1.0, 2.0, 0.0]])
        labels = jnp.array([0, 1, 1, 0])
        metrics.ConfusionMatrix.empty(3).update(logits=logits, labels=labels).compute()
        # [[1 1 0]
        #  [0 1 1]
        #  [0 0 0]]
        ```
    """
    counts: Array  # [C, C] float32 on device, float64 merged
    num_classes: int = struct.field(pytree_node=False, default=2)
    JITTABLE: ClassVar[bool] = True

    @classmethod
    def empty(cls, num_classes: int):
        if num_classes < 1:
            raise ValueError(f"ConfusionMatrix: num_classes must be >= 1, got {num_classes}")
        return cls(counts=zeros(np.float32, (num_classes, num_classes)), num_classes=num_classes)

    def update(self, **batch):
        c = self.num_classes
        labels = jnp.asarray(require(batch, "labels", self)).astype(jnp.int32)
        preds = class_predictions(batch, self).astype(jnp.int32)
        w = entry_weights(batch.get("mask"), labels.shape)
        valid = (w > 0) & (labels >= 0) & (labels < c) & (preds >= 0) & (preds < c)
        # Scatter-add into a flat [C*C]; padded entries point past the end and are dropped.
        index = jnp.where(valid, labels * c + preds, c * c).reshape(-1)
        counts = (jnp.zeros(c * c, jnp.float32).at[index].add(w.reshape(-1), mode="drop")
                  .reshape(c, c))
        return self.merge(self.replace(counts=counts))

    def merge(self, other):
        return sum_merge(self, other)

    def compute(self) -> np.ndarray:
        return to_host(self.counts)


def _safe_divide(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den with 0 where den == 0 (sklearn's zero_division=0)."""
    num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)


@struct.dataclass
class PrecisionRecallF1:
    """Precision, recall and F1 from a (weighted) confusion matrix, sklearn's zero_division=0
    (precision_recall_fscore_support with sample_weight).

    compute() keys: precision_macro, recall_macro, f1_macro, precision_micro, recall_micro,
    f1_micro, and with per_class=True also precision/<i>, recall/<i>, f1/<i>. Macro averages
    run over all num_classes classes (sklearn with labels=range(num_classes)).

    Attributes:
        confusion: the ConfusionMatrix it is computed from.
        per_class: whether compute() adds each class's precision/<i>, recall/<i>, f1/<i>.

    Examples:
        ```python
        import jax.numpy as jnp
        from jtrain import metrics

        logits = jnp.array([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0], [1.0, 2.0, 0.0]])
        labels = jnp.array([0, 1, 1, 0])
        m = metrics.PrecisionRecallF1.empty(3, per_class=False)
        m.update(logits=logits, labels=labels).compute()
        # {'precision_macro': 0.5, 'recall_macro': 0.333, 'f1_macro': 0.389,
        #  'precision_micro': 0.5, 'recall_micro': 0.5, 'f1_micro': 0.5}
        ```
    """
    confusion: ConfusionMatrix
    per_class: bool = struct.field(pytree_node=False, default=True)
    JITTABLE: ClassVar[bool] = True

    @classmethod
    def empty(cls, num_classes: int, per_class: bool = True):
        return cls(confusion=ConfusionMatrix.empty(num_classes), per_class=per_class)

    def update(self, **batch):
        return self.replace(confusion=self.confusion.update(**batch))

    def merge(self, other):
        check_mergeable(self, other)
        return self.replace(confusion=self.confusion.merge(other.confusion))

    def compute(self) -> dict[str, float]:
        cm = self.confusion.compute()
        tp = np.diag(cm)
        predicted, actual = cm.sum(axis=0), cm.sum(axis=1)
        precision = _safe_divide(tp, predicted)
        recall = _safe_divide(tp, actual)
        f1 = _safe_divide(2 * tp, predicted + actual)
        out = {
            "precision_macro": float(precision.mean()),
            "recall_macro": float(recall.mean()),
            "f1_macro": float(f1.mean()),
            "precision_micro": float(_safe_divide(tp.sum(), predicted.sum())),
            "recall_micro": float(_safe_divide(tp.sum(), actual.sum())),
            "f1_micro": float(_safe_divide(2 * tp.sum(), predicted.sum() + actual.sum())),
        }
        if self.per_class:
            for i in range(len(tp)):
                out[f"precision/{i}"] = float(precision[i])
                out[f"recall/{i}"] = float(recall[i])
                out[f"f1/{i}"] = float(f1[i])
        return out


def _support(total) -> int | float:
    return int(total) if float(total).is_integer() else float(total)


def classification_report(confusion) -> dict:
    """sklearn's `classification_report(output_dict=True)` from a [C, C] (true, predicted)
    confusion matrix: {"<i>": {precision, recall, f1-score, support}, "accuracy",
    "macro avg", "weighted avg"}; zero_division=0. A support is the summed weight of a
    class's examples (an int when it is whole)."""
    cm = np.asarray(confusion, np.float64)
    tp = np.diag(cm)
    predicted, support = cm.sum(axis=0), cm.sum(axis=1)
    precision, recall = _safe_divide(tp, predicted), _safe_divide(tp, support)
    f1 = _safe_divide(2 * tp, predicted + support)
    report = {str(i): {"precision": float(precision[i]), "recall": float(recall[i]),
                       "f1-score": float(f1[i]), "support": _support(support[i])}
              for i in range(len(tp))}
    total = support.sum()
    report["accuracy"] = float(_safe_divide(tp.sum(), total))
    weights = _safe_divide(support, total) if total else np.zeros_like(support)
    for name, w in (("macro avg", np.full(len(tp), 1 / max(len(tp), 1))),
                    ("weighted avg", weights)):
        report[name] = {"precision": float((precision * w).sum()),
                        "recall": float((recall * w).sum()),
                        "f1-score": float((f1 * w).sum()), "support": _support(total)}
    return report
