"""Gathered (host-side) metrics: AUROC and Spearman keep every entry that weighs (with its
weight) and are exact."""

from __future__ import annotations

import math
from typing import ClassVar

import jax
import numpy as np
from flax import struct

from jtrain.metrics.base import broadcast_mask, check_mergeable, is_tracer, require


def _fetch(x, who) -> np.ndarray:
    if is_tracer(x):
        raise TypeError(f"{type(who).__name__}.update is host-side: call it outside jax.jit "
                        "on fetched arrays (jax.device_get)")
    return np.asarray(jax.device_get(x))


def _host_weights(batch: dict, shape, who) -> np.ndarray:
    """float64 [shape]: the mask's value where it is > 0, else 0 (a bool mask weighs 1)."""
    mask = batch.get("mask")
    if mask is None:
        return np.ones(shape, np.float64)
    mask = broadcast_mask(_fetch(mask, who), shape, np)
    if mask.dtype == np.bool_:
        return mask.astype(np.float64)
    return np.where(mask > 0, mask.astype(np.float64), 0.0)


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def _midranks(x: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """1-based ranks, ties get their average rank (scipy.stats.rankdata 'average'), an entry
    of weight w counting as w entries (all weights 1: the plain midranks)."""
    _, inverse = np.unique(x, return_inverse=True)
    inverse = inverse.reshape(-1)
    tied = np.bincount(inverse, weights=weights)   # summed weight per distinct value
    ends = np.cumsum(tied)
    return (ends - (tied - 1) / 2.0)[inverse]


def _binary_auroc(positive: np.ndarray, scores: np.ndarray, weights: np.ndarray) -> float:
    """Weighted Mann-Whitney form of the ROC area: the weighted share of (positive, negative)
    pairs ordered right, ties counting one half, as in sklearn's roc_auc_score(sample_weight)."""
    _, inverse = np.unique(scores, return_inverse=True)
    inverse = inverse.reshape(-1)
    pos = np.bincount(inverse, weights=np.where(positive, weights, 0.0))  # per distinct score
    neg = np.bincount(inverse, weights=np.where(positive, 0.0, weights))
    w_pos, w_neg = pos.sum(), neg.sum()
    if not positive.any() or positive.all():
        return math.nan
    below = np.cumsum(neg) - neg                   # negative weight strictly below each score
    return float((pos * (below + neg / 2.0)).sum() / (w_pos * w_neg))


def _concat(chunks: tuple, tail_shape: tuple, dtype) -> np.ndarray:
    if not chunks:
        return np.zeros((0,) + tail_shape, dtype)
    return np.concatenate(chunks, axis=0)


def check_capacity(metric) -> None:
    held = sum(len(c) for c in metric.labels)
    if held > metric.max_examples:
        raise ValueError(
            f"{type(metric).__name__} holds {held} valid examples > max_examples="
            f"{metric.max_examples}; it is exact and keeps every example: raise max_examples "
            f"(about {8 * (metric.num_classes if isinstance(metric, AUROC) else 2) + 16} bytes"
            " each)")


@struct.dataclass
class AUROC:
    """Exact ROC AUC: binary (num_classes=2) or one-vs-rest macro over num_classes >= 3.

    update(labels, scores | logits, mask): host-side, not jittable. Binary: ``scores`` [...]
    (any monotone score of class 1) or [..., 2] (column 1 is used); labels in {0, 1}. Each
    entry weighs its mask (its value if > 0; entries of weight 0 are not kept), as sklearn's
    roc_auc_score with sample_weight: the weighted share of (positive, negative) pairs
    ranked right.
    Multiclass: ``scores`` [..., C] are probabilities as sklearn expects; ``logits`` [..., C]
    are turned into probabilities with a float64 softmax. A class with no positive or no
    negative example has an undefined AUROC: compute() returns nan then (as sklearn does for
    the binary case). Holding more than ``max_examples`` valid examples raises ValueError.

    Attributes:
        scores: the kept scores (numpy, host side).
        labels: the kept labels.
        weights: the kept entries' weights.
        num_classes: 2 for binary, or the classes of a one-vs-rest macro (static).
        max_examples: how many valid entries it may keep (static).

    Examples:
        ```python
        import numpy as np
        from jtrain import metrics

        m = metrics.AUROC.empty().update(scores=np.array([0.1, 0.4, 0.35, 0.8]),
                                        labels=np.array([0, 0, 1, 1]))
        m.compute()                                               # 0.75
        ```
    """
    scores: tuple   # float64 chunks, [n] (binary) or [n, C]
    labels: tuple   # int64 chunks, [n]
    weights: tuple  # float64 chunks, [n]
    num_classes: int = struct.field(pytree_node=False, default=2)
    max_examples: int = struct.field(pytree_node=False, default=1_000_000)
    JITTABLE: ClassVar[bool] = False

    @classmethod
    def empty(cls, num_classes: int = 2, max_examples: int = 1_000_000):
        if num_classes < 2:
            raise ValueError(f"AUROC: num_classes must be >= 2, got {num_classes}")
        return cls(scores=(), labels=(), weights=(), num_classes=num_classes,
                   max_examples=max_examples)

    def update(self, **batch):
        labels = _fetch(require(batch, "labels", self), self)
        if batch.get("scores") is not None:
            scores = _fetch(batch["scores"], self).astype(np.float64)
        else:
            scores = _fetch(require(batch, "logits", self), self).astype(np.float64)
            if scores.shape != labels.shape:
                scores = _softmax(scores)
        if self.num_classes == 2 and scores.shape == labels.shape + (2,):
            scores = scores[..., 1]
        want = labels.shape if self.num_classes == 2 else labels.shape + (self.num_classes,)
        if scores.shape != want:
            raise ValueError(f"AUROC(num_classes={self.num_classes}): scores shape {scores.shape}, "
                             f"expected {want} for labels {labels.shape}")
        w = _host_weights(batch, labels.shape, self)
        valid = w > 0
        part = self.replace(scores=(scores[valid],), labels=(labels[valid].astype(np.int64),),
                            weights=(w[valid],))
        return self.merge(part)

    def merge(self, other):
        check_mergeable(self, other)
        merged = self.replace(scores=self.scores + other.scores, labels=self.labels + other.labels,
                              weights=self.weights + other.weights)
        check_capacity(merged)
        return merged

    def buffers(self) -> dict[str, np.ndarray]:
        tail = () if self.num_classes == 2 else (self.num_classes,)
        return {"scores": _concat(self.scores, tail, np.float64),
                "labels": _concat(self.labels, (), np.int64),
                "weights": _concat(self.weights, (), np.float64)}

    def compute(self) -> float:
        b = self.buffers()
        if self.num_classes == 2:
            return _binary_auroc(b["labels"] == 1, b["scores"], b["weights"])
        per_class = [_binary_auroc(b["labels"] == c, b["scores"][:, c], b["weights"])
                     for c in range(self.num_classes)]
        return float(np.mean(per_class))


@struct.dataclass
class Spearman:
    """Spearman rank correlation of preds and labels (ties get average ranks, like scipy).

    Each pair weighs its mask (its value if > 0; pairs of weight 0 are not kept) as that
    many copies of the pair would: weighted midranks, then their weighted Pearson
    correlation (every weight 1: scipy's spearmanr). Host-side, not jittable: keeps every
    pair that weighs; more than ``max_examples`` raises.

    Attributes:
        preds: the kept predictions, float64 chunks on the host.
        labels: the kept labels, likewise.
        weights: the kept pairs' weights, likewise.
        max_examples: how many valid pairs it may keep (static).

    Examples:
        ```python
        import numpy as np
        from jtrain.metrics import Spearman

        preds, labels = np.array([1.0, 2.0, 3.0, 4.0]), np.array([1.0, 3.0, 2.0, 4.0])
        Spearman.empty().update(preds=preds, labels=labels).compute()   # 0.8
        ```
    """
    preds: tuple    # float64 chunks [n]
    labels: tuple   # float64 chunks [n]
    weights: tuple  # float64 chunks [n]
    max_examples: int = struct.field(pytree_node=False, default=1_000_000)
    JITTABLE: ClassVar[bool] = False

    @classmethod
    def empty(cls, max_examples: int = 1_000_000):
        return cls(preds=(), labels=(), weights=(), max_examples=max_examples)

    def update(self, **batch):
        preds = _fetch(require(batch, "preds", self), self).astype(np.float64)
        labels = _fetch(require(batch, "labels", self), self).astype(np.float64)
        if preds.shape != labels.shape:
            raise ValueError(f"Spearman: preds {preds.shape} and labels {labels.shape} differ")
        w = _host_weights(batch, labels.shape, self)
        valid = w > 0
        return self.merge(self.replace(preds=(preds[valid],), labels=(labels[valid],),
                                       weights=(w[valid],)))

    def merge(self, other):
        check_mergeable(self, other)
        merged = self.replace(preds=self.preds + other.preds, labels=self.labels + other.labels,
                              weights=self.weights + other.weights)
        check_capacity(merged)
        return merged

    def buffers(self) -> dict[str, np.ndarray]:
        return {"preds": _concat(self.preds, (), np.float64),
                "labels": _concat(self.labels, (), np.float64),
                "weights": _concat(self.weights, (), np.float64)}

    def compute(self) -> float:
        b = self.buffers()
        if len(b["preds"]) < 2:
            return math.nan
        w = b["weights"]
        rx, ry = _midranks(b["preds"], w), _midranks(b["labels"], w)
        rx, ry = rx - np.average(rx, weights=w), ry - np.average(ry, weights=w)
        den = math.sqrt(float((w * rx) @ rx) * float((w * ry) @ ry))
        return float(np.clip(((w * rx) @ ry) / den, -1.0, 1.0)) if den > 0 else math.nan
