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
multiplying, so NaN / inf / out-of-range garbage in padded rows cannot leak. ``Average`` and
its kin (``Loss``, ``Perplexity``, ``BitsPerByte``) read a float mask as a weight; every other
metric counts an entry iff ``mask > 0``.

Jittable: ``update`` works inside ``jax.jit`` (also on sharded batches) and the state is a
fixed-shape pytree: Average, Loss, Perplexity, BitsPerByte, Accuracy, TopKAccuracy,
ConfusionMatrix, PrecisionRecallF1, MSE, MAE, R2, Pearson (class attribute ``JITTABLE``).
Host-side: AUROC and Spearman need every (score, label) pair; their ``update`` takes fetched
arrays outside jit, drops padded entries, and appends to numpy buffers. They are exact, and
raise once more than ``max_examples`` valid entries are held (no approximation).

Precision. On device one batch contributes float32 sums and int32 counts (XLA's reductions:
~5e-8 relative error for 1M float32 values on CPU). ``merge`` outside jit turns leaves into
numpy float64 / int64, and ``update`` outside jit is ``merge(state_of_batch)``, so accumulation
across batches and hosts is float64. Second moments (R2, Pearson) are centred per batch and
merged with Chan et al.'s parallel formula, which avoids the cancellation of sum-of-squares
formulas. The exact pattern for an eval loop:

    step = jax.jit(lambda batch: template.update(**batch))   # one batch's state, float32
    total = template
    for batch in batches:
        total = total.merge(step(batch))                      # float64 on the host

Carrying the state through jit (``jit(lambda m, b: m.update(**b))``) accumulates in float32.
Metrics are immutable, so an ``empty()`` template can be reused for every evaluation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import multihost_utils

Array = Any

# ----------------------------------------------------------------------------------------
# Shared helpers


def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _to_host(x) -> np.ndarray:
    """A state leaf as numpy float64 / int64, the host accumulation dtypes."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if not x.is_fully_replicated:
            raise ValueError(
                "metric state leaf is sharded across processes; return metric states replicated"
                " from the jitted step (they are sums, so replicated is the natural layout)")
        x = x.addressable_data(0)
    x = np.asarray(x)
    if np.issubdtype(x.dtype, np.floating):
        return x.astype(np.float64)
    if np.issubdtype(x.dtype, np.integer) or x.dtype == np.bool_:
        return x.astype(np.int64)
    return x


def _add(a, b):
    if _is_tracer(a) or _is_tracer(b):
        return a + b  # under jit: stays on device, in the device dtype
    return _to_host(a) + _to_host(b)


def _static_options(metric) -> dict[str, Any]:
    return {f.name: getattr(metric, f.name) for f in dataclasses.fields(metric)
            if not f.metadata.get("pytree_node", True)}


def _check_mergeable(a, b) -> None:
    if type(a) is not type(b):
        raise TypeError(f"cannot merge {type(a).__name__} with {type(b).__name__}")
    if _static_options(a) != _static_options(b):
        raise ValueError(f"cannot merge {type(a).__name__} states with different options: "
                         f"{_static_options(a)} vs {_static_options(b)}")


def _sum_merge(a, b):
    _check_mergeable(a, b)
    return jax.tree.map(_add, a, b)


def _get(batch: dict, key: str, who) -> Array:
    value = batch.get(key)
    if value is None:
        raise KeyError(f"{type(who).__name__}.update needs batch[{key!r}]; got keys "
                       f"{sorted(k for k, v in batch.items() if v is not None)}")
    return value


def _broadcast_mask(mask, shape, xp):
    """mask [prefix of shape] -> mask broadcast to shape."""
    mask = xp.asarray(mask)
    if tuple(shape[:mask.ndim]) != tuple(mask.shape):
        raise ValueError(f"mask shape {tuple(mask.shape)} is not a prefix of {tuple(shape)}")
    mask = mask.reshape(mask.shape + (1,) * (len(shape) - mask.ndim))
    return xp.broadcast_to(mask, shape)


def _valid(mask, shape) -> jax.Array:
    """bool [shape]: True for real entries, False for padding."""
    if mask is None:
        return jnp.ones(shape, bool)
    mask = _broadcast_mask(mask, shape, jnp)
    return mask if mask.dtype == jnp.bool_ else mask > 0


def _masked_sum(values, valid) -> jax.Array:
    return jnp.sum(jnp.where(valid, values, 0), dtype=jnp.float32)


def _class_predictions(batch: dict, who) -> jax.Array:
    if batch.get("logits") is not None:
        return jnp.argmax(jnp.asarray(batch["logits"]), axis=-1)
    return jnp.asarray(_get(batch, "preds", who))


def _ratio(num, den) -> float:
    num, den = _to_host(num), _to_host(den)
    return float(num / den) if den > 0 else math.nan


def _zeros(dtype, shape=()) -> np.ndarray:
    return np.zeros(shape, dtype)


# ----------------------------------------------------------------------------------------
# Weighted means: loss, perplexity, bits per byte


@struct.dataclass
class Average:
    """Weighted mean of ``batch[key]`` (per example [B] or per token [B, T]).

    A float mask is a weight (0 = padding). compute() -> float (nan when nothing was seen).
    """
    total: Array    # float32 on device, float64 after a host merge
    count: Array    # sum of weights
    key: str = struct.field(pytree_node=False, default="values")
    JITTABLE: ClassVar[bool] = True

    @classmethod
    def empty(cls, key: str = "values"):
        return cls(total=_zeros(np.float32), count=_zeros(np.float32), key=key)

    def update(self, **batch):
        values = jnp.asarray(_get(batch, self.key, self), jnp.float32)
        mask = batch.get("mask")
        if mask is None:
            weight = jnp.ones(values.shape, jnp.float32)
        else:
            mask = _broadcast_mask(mask, values.shape, jnp)
            weight = jnp.where(mask > 0, mask.astype(jnp.float32), 0.0)
        part = self.replace(
            total=jnp.sum(jnp.where(weight > 0, values * weight, 0.0)),
            count=jnp.sum(weight))
        return self.merge(part)

    def merge(self, other):
        return _sum_merge(self, other)

    def mean(self) -> float:
        return _ratio(self.total, self.count)

    def compute(self) -> float:
        return self.mean()


@struct.dataclass
class Loss(Average):
    """Average of ``batch["loss"]``."""

    @classmethod
    def empty(cls, key: str = "loss"):
        return super().empty(key=key)


@struct.dataclass
class Perplexity(Average):
    """exp(mean token cross-entropy in nats), from ``batch["loss"]`` (per token) and mask."""

    @classmethod
    def empty(cls, key: str = "loss"):
        return super().empty(key=key)

    def compute(self) -> float:
        try:
            return math.exp(self.mean())
        except OverflowError:
            return math.inf


@struct.dataclass
class BitsPerByte(Average):
    """mean cross-entropy (nats per byte) / ln 2, for byte-level language models."""

    @classmethod
    def empty(cls, key: str = "loss"):
        return super().empty(key=key)

    def compute(self) -> float:
        return self.mean() / math.log(2.0)


# ----------------------------------------------------------------------------------------
# Classification


@struct.dataclass
class Accuracy:
    """argmax(logits, -1) == labels (or integer ``preds`` == labels), token level for [B, T]."""
    correct: Array  # int32
    count: Array    # int32
    JITTABLE: ClassVar[bool] = True

    @classmethod
    def empty(cls):
        return cls(correct=_zeros(np.int32), count=_zeros(np.int32))

    def update(self, **batch):
        labels = jnp.asarray(_get(batch, "labels", self))
        valid = _valid(batch.get("mask"), labels.shape)
        hit = valid & (_class_predictions(batch, self) == labels)
        return self.merge(self.replace(correct=jnp.sum(hit, dtype=jnp.int32),
                                       count=jnp.sum(valid, dtype=jnp.int32)))

    def merge(self, other):
        return _sum_merge(self, other)

    def compute(self) -> float:
        return _ratio(self.correct, self.count)


@struct.dataclass
class TopKAccuracy:
    """The label's logit is among the k largest (ties count as hits); needs ``logits``."""
    correct: Array
    count: Array
    k: int = struct.field(pytree_node=False, default=5)
    JITTABLE: ClassVar[bool] = True

    @classmethod
    def empty(cls, k: int = 5):
        if k < 1:
            raise ValueError(f"TopKAccuracy: k must be >= 1, got {k}")
        return cls(correct=_zeros(np.int32), count=_zeros(np.int32), k=k)

    def update(self, **batch):
        logits = jnp.asarray(_get(batch, "logits", self))   # [..., C]
        labels = jnp.asarray(_get(batch, "labels", self))   # [...]
        num_classes = logits.shape[-1]
        valid = _valid(batch.get("mask"), labels.shape)
        in_range = (labels >= 0) & (labels < num_classes)
        safe = jnp.where(valid & in_range, labels, 0)
        label_logit = jnp.take_along_axis(logits, safe[..., None], axis=-1)  # [..., 1]
        rank = jnp.sum(logits > label_logit, axis=-1)                         # [...]
        hit = valid & in_range & (rank < self.k)
        return self.merge(self.replace(correct=jnp.sum(hit, dtype=jnp.int32),
                                       count=jnp.sum(valid, dtype=jnp.int32)))

    def merge(self, other):
        return _sum_merge(self, other)

    def compute(self) -> float:
        return _ratio(self.correct, self.count)


@struct.dataclass
class ConfusionMatrix:
    """counts[true, predicted] (sklearn's layout), from ``logits`` or integer ``preds``.

    Valid entries whose label or prediction lies outside [0, num_classes) are not counted.
    compute() -> int64 array [C, C] (not a scalar: use PrecisionRecallF1 in a collection).
    """
    counts: Array  # [C, C] int32
    num_classes: int = struct.field(pytree_node=False, default=2)
    JITTABLE: ClassVar[bool] = True

    @classmethod
    def empty(cls, num_classes: int):
        if num_classes < 1:
            raise ValueError(f"ConfusionMatrix: num_classes must be >= 1, got {num_classes}")
        return cls(counts=_zeros(np.int32, (num_classes, num_classes)), num_classes=num_classes)

    def update(self, **batch):
        c = self.num_classes
        labels = jnp.asarray(_get(batch, "labels", self)).astype(jnp.int32)
        preds = _class_predictions(batch, self).astype(jnp.int32)
        valid = (_valid(batch.get("mask"), labels.shape) & (labels >= 0) & (labels < c)
                 & (preds >= 0) & (preds < c))
        # Scatter-add into a flat [C*C]; padded entries point past the end and are dropped.
        index = jnp.where(valid, labels * c + preds, c * c).reshape(-1)
        counts = jnp.zeros(c * c, jnp.int32).at[index].add(1, mode="drop").reshape(c, c)
        return self.merge(self.replace(counts=counts))

    def merge(self, other):
        return _sum_merge(self, other)

    def compute(self) -> np.ndarray:
        return _to_host(self.counts)


def _safe_divide(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den with 0 where den == 0 (sklearn's zero_division=0)."""
    num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)


@struct.dataclass
class PrecisionRecallF1:
    """Precision, recall and F1 from a confusion matrix, sklearn's zero_division=0.

    compute() keys: precision_macro, recall_macro, f1_macro, precision_micro, recall_micro,
    f1_micro, and with per_class=True also precision/<i>, recall/<i>, f1/<i>. Macro averages
    run over all num_classes classes (sklearn with labels=range(num_classes)).
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
        _check_mergeable(self, other)
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


# ----------------------------------------------------------------------------------------
# Regression: float ``preds`` vs ``labels`` (any shape, flattened; mask a prefix of it)


@struct.dataclass
class MSE:
    total: Array
    count: Array
    JITTABLE: ClassVar[bool] = True

    @classmethod
    def empty(cls):
        return cls(total=_zeros(np.float32), count=_zeros(np.float32))

    def _error(self, preds, labels):
        return jnp.square(preds - labels)

    def update(self, **batch):
        preds = jnp.asarray(_get(batch, "preds", self), jnp.float32)
        labels = jnp.asarray(_get(batch, "labels", self), jnp.float32)
        valid = _valid(batch.get("mask"), labels.shape)
        return self.merge(self.replace(total=_masked_sum(self._error(preds, labels), valid),
                                       count=jnp.sum(valid, dtype=jnp.float32)))

    def merge(self, other):
        return _sum_merge(self, other)

    def compute(self) -> float:
        return _ratio(self.total, self.count)


@struct.dataclass
class MAE(MSE):

    def _error(self, preds, labels):
        return jnp.abs(preds - labels)


@struct.dataclass
class Moments:
    """Count, means and centred second moments of (x, y); merged with Chan's formula."""
    n: Array
    mean_x: Array
    mean_y: Array
    m2x: Array   # sum (x - mean_x)^2
    m2y: Array   # sum (y - mean_y)^2
    cxy: Array   # sum (x - mean_x)(y - mean_y)

    @classmethod
    def empty(cls):
        return cls(*(_zeros(np.float32) for _ in range(6)))

    @classmethod
    def of_batch(cls, x, y, valid):
        n = jnp.sum(valid, dtype=jnp.float32)
        safe_n = jnp.maximum(n, 1.0)
        mean_x = _masked_sum(x, valid) / safe_n
        mean_y = _masked_sum(y, valid) / safe_n
        dx = jnp.where(valid, x - mean_x, 0.0)
        dy = jnp.where(valid, y - mean_y, 0.0)
        return cls(n=n, mean_x=mean_x, mean_y=mean_y, m2x=jnp.sum(dx * dx),
                   m2y=jnp.sum(dy * dy), cxy=jnp.sum(dx * dy))

    def merge(self, other):
        if any(_is_tracer(x) for x in jax.tree.leaves((self, other))):
            xp, a, b = jnp, self, other
        else:
            xp, a, b = np, jax.tree.map(_to_host, self), jax.tree.map(_to_host, other)
        n = a.n + b.n
        frac = b.n / xp.where(n > 0, n, 1.0)    # weight of b in the merged mean
        cross = a.n * frac                       # = na * nb / n
        dx, dy = b.mean_x - a.mean_x, b.mean_y - a.mean_y
        return Moments(n=n, mean_x=a.mean_x + dx * frac, mean_y=a.mean_y + dy * frac,
                       m2x=a.m2x + b.m2x + dx * dx * cross,
                       m2y=a.m2y + b.m2y + dy * dy * cross,
                       cxy=a.cxy + b.cxy + dx * dy * cross)


def _regression_batch(metric, batch):
    preds = jnp.asarray(_get(batch, "preds", metric), jnp.float32)
    labels = jnp.asarray(_get(batch, "labels", metric), jnp.float32)
    return preds, labels, _valid(batch.get("mask"), labels.shape)


@struct.dataclass
class R2:
    """Coefficient of determination, pooled over all entries (sklearn's r2_score on the
    flattened arrays): nan for n < 2; 1.0 / 0.0 for constant labels (force_finite)."""
    moments: Moments
    sse: Array
    JITTABLE: ClassVar[bool] = True

    @classmethod
    def empty(cls):
        return cls(moments=Moments.empty(), sse=_zeros(np.float32))

    def update(self, **batch):
        preds, labels, valid = _regression_batch(self, batch)
        part = R2(moments=Moments.of_batch(preds, labels, valid),
                  sse=_masked_sum(jnp.square(preds - labels), valid))
        return self.merge(part)

    def merge(self, other):
        _check_mergeable(self, other)
        return R2(moments=self.moments.merge(other.moments), sse=_add(self.sse, other.sse))

    def compute(self) -> float:
        n, sst, sse = (float(_to_host(v)) for v in (self.moments.n, self.moments.m2y, self.sse))
        if n < 2:
            return math.nan
        if sst == 0.0:
            return 1.0 if sse == 0.0 else 0.0
        return 1.0 - sse / sst


@struct.dataclass
class Pearson:
    """Pearson correlation of preds and labels from merged moments (nan if n < 2 or constant)."""
    moments: Moments
    JITTABLE: ClassVar[bool] = True

    @classmethod
    def empty(cls):
        return cls(moments=Moments.empty())

    def update(self, **batch):
        return self.merge(Pearson(moments=Moments.of_batch(*_regression_batch(self, batch))))

    def merge(self, other):
        _check_mergeable(self, other)
        return Pearson(moments=self.moments.merge(other.moments))

    def compute(self) -> float:
        m = jax.tree.map(_to_host, self.moments)
        if m.n < 2 or m.m2x <= 0 or m.m2y <= 0:
            return math.nan
        return float(np.clip(m.cxy / np.sqrt(m.m2x * m.m2y), -1.0, 1.0))


# ----------------------------------------------------------------------------------------
# Gathered (host-side) metrics: exact, keep every valid entry


def _fetch(x, who) -> np.ndarray:
    if _is_tracer(x):
        raise TypeError(f"{type(who).__name__}.update is host-side: call it outside jax.jit "
                        "on fetched arrays (jax.device_get)")
    return np.asarray(jax.device_get(x))


def _host_valid(batch: dict, shape, who) -> np.ndarray:
    mask = batch.get("mask")
    if mask is None:
        return np.ones(shape, bool)
    mask = _broadcast_mask(_fetch(mask, who), shape, np)
    return mask if mask.dtype == np.bool_ else mask > 0


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def _midranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks, ties get their average rank (scipy.stats.rankdata 'average')."""
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    return (ends - (counts - 1) / 2.0)[inverse.reshape(-1)]


def _binary_auroc(positive: np.ndarray, scores: np.ndarray) -> float:
    """Mann-Whitney form of the ROC area; ties count one half, as in sklearn's roc_auc_score."""
    n_pos = int(positive.sum())
    n_neg = positive.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    rank_sum = _midranks(scores)[positive].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def _concat(chunks: tuple, tail_shape: tuple, dtype) -> np.ndarray:
    if not chunks:
        return np.zeros((0,) + tail_shape, dtype)
    return np.concatenate(chunks, axis=0)


def _check_capacity(metric) -> None:
    held = sum(len(c) for c in metric.labels)
    if held > metric.max_examples:
        raise ValueError(
            f"{type(metric).__name__} holds {held} valid examples > max_examples="
            f"{metric.max_examples}; it is exact and keeps every example: raise max_examples "
            f"(about {16 * (metric.num_classes if isinstance(metric, AUROC) else 2)} bytes each)")


@struct.dataclass
class AUROC:
    """Exact ROC AUC: binary (num_classes=2) or one-vs-rest macro over num_classes >= 3.

    update(labels, scores | logits, mask): host-side, not jittable. Binary: ``scores`` [...]
    (any monotone score of class 1) or [..., 2] (column 1 is used); labels in {0, 1}.
    Multiclass: ``scores`` [..., C] are probabilities as sklearn expects; ``logits`` [..., C]
    are turned into probabilities with a float64 softmax. A class with no positive or no
    negative example has an undefined AUROC: compute() returns nan then (as sklearn does for
    the binary case). Holding more than ``max_examples`` valid examples raises ValueError.
    """
    scores: tuple   # float64 chunks, [n] (binary) or [n, C]
    labels: tuple   # int64 chunks, [n]
    num_classes: int = struct.field(pytree_node=False, default=2)
    max_examples: int = struct.field(pytree_node=False, default=1_000_000)
    JITTABLE: ClassVar[bool] = False

    @classmethod
    def empty(cls, num_classes: int = 2, max_examples: int = 1_000_000):
        if num_classes < 2:
            raise ValueError(f"AUROC: num_classes must be >= 2, got {num_classes}")
        return cls(scores=(), labels=(), num_classes=num_classes, max_examples=max_examples)

    def update(self, **batch):
        labels = _fetch(_get(batch, "labels", self), self)
        if batch.get("scores") is not None:
            scores = _fetch(batch["scores"], self).astype(np.float64)
        else:
            scores = _fetch(_get(batch, "logits", self), self).astype(np.float64)
            if scores.shape != labels.shape:
                scores = _softmax(scores)
        if self.num_classes == 2 and scores.shape == labels.shape + (2,):
            scores = scores[..., 1]
        want = labels.shape if self.num_classes == 2 else labels.shape + (self.num_classes,)
        if scores.shape != want:
            raise ValueError(f"AUROC(num_classes={self.num_classes}): scores shape {scores.shape}, "
                             f"expected {want} for labels {labels.shape}")
        valid = _host_valid(batch, labels.shape, self)
        part = self.replace(scores=(scores[valid],), labels=(labels[valid].astype(np.int64),))
        return self.merge(part)

    def merge(self, other):
        _check_mergeable(self, other)
        merged = self.replace(scores=self.scores + other.scores, labels=self.labels + other.labels)
        _check_capacity(merged)
        return merged

    def buffers(self) -> dict[str, np.ndarray]:
        tail = () if self.num_classes == 2 else (self.num_classes,)
        return {"scores": _concat(self.scores, tail, np.float64),
                "labels": _concat(self.labels, (), np.int64)}

    def compute(self) -> float:
        b = self.buffers()
        if self.num_classes == 2:
            return _binary_auroc(b["labels"] == 1, b["scores"])
        per_class = [_binary_auroc(b["labels"] == c, b["scores"][:, c])
                     for c in range(self.num_classes)]
        return float(np.mean(per_class))


@struct.dataclass
class Spearman:
    """Spearman rank correlation of preds and labels (ties get average ranks, like scipy).

    Host-side, not jittable: keeps every valid pair; more than ``max_examples`` raises.
    """
    preds: tuple    # float64 chunks [n]
    labels: tuple   # float64 chunks [n]
    max_examples: int = struct.field(pytree_node=False, default=1_000_000)
    JITTABLE: ClassVar[bool] = False

    @classmethod
    def empty(cls, max_examples: int = 1_000_000):
        return cls(preds=(), labels=(), max_examples=max_examples)

    def update(self, **batch):
        preds = _fetch(_get(batch, "preds", self), self).astype(np.float64)
        labels = _fetch(_get(batch, "labels", self), self).astype(np.float64)
        if preds.shape != labels.shape:
            raise ValueError(f"Spearman: preds {preds.shape} and labels {labels.shape} differ")
        valid = _host_valid(batch, labels.shape, self)
        return self.merge(self.replace(preds=(preds[valid],), labels=(labels[valid],)))

    def merge(self, other):
        _check_mergeable(self, other)
        merged = self.replace(preds=self.preds + other.preds, labels=self.labels + other.labels)
        _check_capacity(merged)
        return merged

    def buffers(self) -> dict[str, np.ndarray]:
        return {"preds": _concat(self.preds, (), np.float64),
                "labels": _concat(self.labels, (), np.float64)}

    def compute(self) -> float:
        b = self.buffers()
        if len(b["preds"]) < 2:
            return math.nan
        rx, ry = _midranks(b["preds"]), _midranks(b["labels"])
        rx, ry = rx - rx.mean(), ry - ry.mean()
        den = math.sqrt(float(rx @ rx) * float(ry @ ry))
        return float(np.clip((rx @ ry) / den, -1.0, 1.0)) if den > 0 else math.nan


# ----------------------------------------------------------------------------------------
# Collections


@struct.dataclass
class MetricCollection:
    """Named metrics updated with the same batch; compute() flattens to one dict of floats.

    A metric computing a float is reported under its name; one computing a dict contributes
    its own keys (e.g. f1_macro). ConfusionMatrix is not allowed (it computes a matrix): use
    PrecisionRecallF1 and read ``collection.metrics[name].confusion.compute()``.
    """
    metrics: dict[str, Any]

    @classmethod
    def empty(cls, metrics: dict[str, Any]):
        for name, metric in metrics.items():
            if isinstance(metric, ConfusionMatrix):
                raise TypeError(
                    f"MetricCollection[{name!r}]: ConfusionMatrix computes a matrix, not "
                    "scalars; use PrecisionRecallF1 (it holds the confusion matrix)")
            if not all(hasattr(metric, m) for m in ("update", "merge", "compute", "JITTABLE")):
                raise TypeError(f"MetricCollection[{name!r}]: {metric!r} is not a metric")
        return cls(metrics=dict(metrics))

    @property
    def JITTABLE(self) -> bool:  # noqa: N802  (same spelling as the metrics' class attribute)
        return all(m.JITTABLE for m in self.metrics.values())

    def partition(self) -> tuple[MetricCollection, MetricCollection]:
        """(jittable metrics, host-side metrics), to update on device and on host."""
        return (self.replace(metrics={k: m for k, m in self.metrics.items() if m.JITTABLE}),
                self.replace(metrics={k: m for k, m in self.metrics.items() if not m.JITTABLE}))

    def update(self, **batch):
        return self.replace(metrics={k: m.update(**batch) for k, m in self.metrics.items()})

    def merge(self, other):
        if not isinstance(other, MetricCollection) or other.metrics.keys() != self.metrics.keys():
            raise ValueError("cannot merge metric collections with different metric names")
        return self.replace(metrics={k: m.merge(other.metrics[k]) for k, m in self.metrics.items()})

    def compute(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, metric in self.metrics.items():
            value = metric.compute()
            items = value.items() if isinstance(value, dict) else [(name, value)]
            for key, v in items:
                if key in out:
                    raise ValueError(f"MetricCollection: two metrics produce the key {key!r}")
                out[key] = float(v)
        return out


# ----------------------------------------------------------------------------------------
# Across processes


def _allgather_exact(tree):
    """process_allgather (stacked: leaves get a leading [P] axis) keeping float64 / int64.

    Without jax_enable_x64 JAX would cast 64-bit values to 32 bits, so each leaf travels as
    its raw bytes in uint32 words.
    """
    leaves, treedef = jax.tree.flatten(tree)
    host = [_to_host(x) for x in leaves]
    # (np.ascontiguousarray would turn 0-d leaves into 1-d ones: flatten first.)
    words = [np.ascontiguousarray(x.reshape(-1)).view(np.uint32) for x in host]
    gathered = multihost_utils.process_allgather(words)
    out = [np.ascontiguousarray(np.asarray(g, np.uint32)).view(x.dtype).reshape((-1,) + x.shape)
           for g, x in zip(gathered, host)]
    return jax.tree.unflatten(treedef, out)


def _gather_buffers(metric):
    """Concatenates every process's buffers, in process order (lengths may differ)."""
    buffers = metric.buffers()                  # name -> [n, ...], masked entries already gone
    n = len(next(iter(buffers.values())))
    lengths = _allgather_exact(np.array(n, np.int64)).reshape(-1)   # [P]
    width = max(int(lengths.max()), 1)
    padded = {k: np.concatenate([v, np.zeros((width - n,) + v.shape[1:], v.dtype)])
              for k, v in buffers.items()}
    gathered = _allgather_exact(padded)         # name -> [P, width, ...]
    merged = metric.replace(**{
        k: (np.concatenate([g[p, :lengths[p]] for p in range(len(lengths))]),)
        for k, g in gathered.items()})
    _check_capacity(merged)
    return merged


def reduce_across_processes(metric):
    """The metric over all ``jax.process_count()`` processes (identity for one process).

    Sum-style states are gathered and merged (Chan's formula where it applies), in float64.
    Host-side metrics (AUROC, Spearman) concatenate their buffers, whose lengths may differ
    per process. Every process must call this with the same metric structure (a collective).
    A state whose leaves are global arrays spanning processes came out of a jitted step over
    a global batch: it already covers every process and is only fetched, not summed again.
    """
    if jax.process_count() == 1:
        return metric
    if isinstance(metric, MetricCollection):
        return metric.replace(metrics={k: reduce_across_processes(m)
                                       for k, m in sorted(metric.metrics.items())})
    if any(isinstance(x, jax.Array) and not x.is_fully_addressable
           for x in jax.tree.leaves(metric)):
        return jax.tree.map(_to_host, metric)
    if not metric.JITTABLE:
        return _gather_buffers(metric)
    stacked = _allgather_exact(metric)
    parts = [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(jax.process_count())]
    return functools.reduce(lambda a, b: a.merge(b), parts)
