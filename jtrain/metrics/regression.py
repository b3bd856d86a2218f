"""Regression: float ``preds`` vs ``labels`` (any shape, flattened; mask a prefix of it)."""

from __future__ import annotations

import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jtrain.metrics.base import (Array, check_mergeable, entry_weights, merge_operands, ratio,
                                 require, sum_merge, to_host, weighted_sum, zeros)


@struct.dataclass
class MSE:
    """Mean squared error of `preds` against `labels`, each entry weighing its mask (its
    value if > 0, else 0): sklearn's mean_squared_error with sample_weight.

    Attributes:
        total: the weighted sum of the squared errors.
        count: the summed weight of the entries.

    Examples:
        ```python
        import jax.numpy as jnp
        from jtrain import metrics

        preds, labels = jnp.array([1.0, 2.0, 3.0, 5.0]), jnp.array([1.0, 2.0, 4.0, 4.0])
        metrics.MSE.empty().update(preds=preds, labels=labels).compute()   # 0.5
        a = metrics.MSE.empty().update(preds=preds[:2], labels=labels[:2])
        b = metrics.MSE.empty().update(preds=preds[2:], labels=labels[2:])
        a.merge(b).compute()                                    # 0.5: merging is exact
        ```
    """
    total: Array
    count: Array
    JITTABLE: ClassVar[bool] = True

    @classmethod
    def empty(cls):
        return cls(total=zeros(np.float32), count=zeros(np.float32))

    def _error(self, preds, labels):
        return jnp.square(preds - labels)

    def update(self, **batch):
        preds = jnp.asarray(require(batch, "preds", self), jnp.float32)
        labels = jnp.asarray(require(batch, "labels", self), jnp.float32)
        w = entry_weights(batch.get("mask"), labels.shape)
        return self.merge(self.replace(total=weighted_sum(self._error(preds, labels), w),
                                       count=jnp.sum(w, dtype=jnp.float32)))

    def merge(self, other):
        return sum_merge(self, other)

    def compute(self) -> float:
        return ratio(self.total, self.count)


@struct.dataclass
class MAE(MSE):

    """Mean absolute error of `preds` against `labels`, weighted as `MSE`; its fields are
    those of `MSE`, `total` the weighted sum of the absolute errors.

    Examples:
        ```python
        import jax.numpy as jnp
        from jtrain import metrics

        preds, labels = jnp.array([1.0, 2.0, 3.0, 5.0]), jnp.array([1.0, 2.0, 4.0, 4.0])
        metrics.MAE.empty().update(preds=preds, labels=labels).compute()   # 0.5
        ```
    """
    def _error(self, preds, labels):
        return jnp.abs(preds - labels)


@struct.dataclass
class Moments:
    """Weighted means and centred second moments of (x, y); merged with Chan's formula
    (n is the summed weight; with every weight 1, the plain moments).

    Attributes:
        n: the summed weight of the pairs.
        mean_x: the weighted mean of x.
        mean_y: the weighted mean of y.
        m2x: the weighted sum of squared deviations of x from its mean.
        m2y: the same of y.
        cxy: the weighted sum of the products of the deviations of x and y.
        count: how many pairs weigh (weight > 0), whatever their weight.

    Examples:
        ```python
        import jax.numpy as jnp
        from jtrain import metrics

        m = metrics.Moments.empty()     # what Pearson keeps; merge() is Chan's formula
        ```
    """
    n: Array
    mean_x: Array
    mean_y: Array
    m2x: Array   # sum (x - mean_x)^2
    m2y: Array   # sum (y - mean_y)^2
    cxy: Array   # sum w (x - mean_x)(y - mean_y)
    count: Array  # pairs with w > 0: "fewer than 2 pairs" is a count, not a weight

    @classmethod
    def empty(cls):
        return cls(*(zeros(np.float32) for _ in range(7)))

    @classmethod
    def of_batch(cls, x, y, w):
        n = jnp.sum(w, dtype=jnp.float32)
        safe_n = jnp.where(n > 0, n, 1.0)
        mean_x = weighted_sum(x, w) / safe_n
        mean_y = weighted_sum(y, w) / safe_n
        dx = jnp.where(w > 0, x - mean_x, 0.0)
        dy = jnp.where(w > 0, y - mean_y, 0.0)
        return cls(n=n, mean_x=mean_x, mean_y=mean_y, m2x=jnp.sum(w * dx * dx),
                   m2y=jnp.sum(w * dy * dy), cxy=jnp.sum(w * dx * dy),
                   count=jnp.sum(w > 0, dtype=jnp.float32))

    def merge(self, other):
        xp, a, b = merge_operands(self, other)
        n = a.n + b.n
        frac = b.n / xp.where(n > 0, n, 1.0)    # weight of b in the merged mean
        cross = a.n * frac                       # = na * nb / n
        dx, dy = b.mean_x - a.mean_x, b.mean_y - a.mean_y
        return Moments(n=n, mean_x=a.mean_x + dx * frac, mean_y=a.mean_y + dy * frac,
                       m2x=a.m2x + b.m2x + dx * dx * cross,
                       m2y=a.m2y + b.m2y + dy * dy * cross,
                       cxy=a.cxy + b.cxy + dx * dy * cross, count=a.count + b.count)


def _regression_batch(metric, batch):
    preds = jnp.asarray(require(batch, "preds", metric), jnp.float32)
    labels = jnp.asarray(require(batch, "labels", metric), jnp.float32)
    return preds, labels, entry_weights(batch.get("mask"), labels.shape)


@struct.dataclass
class R2:
    """Coefficient of determination as scikit-learn's r2_score computes it by default
    (multioutput="uniform_average"): labels [...] scored as `num_outputs` outputs, the last
    axis (sklearn's columns; with 1, every entry is a sample of one output), every other
    axis indexing samples; R² of each output, then their plain mean. Pooling the entries
    of several outputs instead would count the differences between the outputs' means as
    explained variance. Each entry weighs its mask (its value if > 0, else 0), as
    sklearn's sample_weight. Per output: nan for fewer than 2 counted entries (weight > 0;
    left out of the mean; nan if every output is); 1.0 / 0.0 for constant labels
    (force_finite).

    The state, per output: the summed weight, the weighted label mean, the weighted centred
    label sum of squares, the weighted residual sum of squares and the count, merged with
    Chan's formula (exact across batches, devices and hosts).

    Attributes:
        n: the summed weight of the entries per output.
        mean: the labels' weighted mean per output.
        m2: the labels' weighted sum of squared deviations per output.
        sse: the weighted sum of squared errors per output.
        count: the count of entries with weight > 0 per output.
        num_outputs: how many outputs are scored apart (static).

    Examples:
        ```python
        import jax.numpy as jnp
        from jtrain import metrics

        preds, labels = jnp.array([1.0, 2.0, 3.0, 5.0]), jnp.array([1.0, 2.0, 4.0, 4.0])
        metrics.R2.empty().update(preds=preds, labels=labels).compute()   # 0.7037
        ```
    """
    n: Array      # [k] counted entries
    mean: Array   # [k] label mean
    m2: Array     # [k] sum (label - mean)^2
    sse: Array    # [k] sum w (pred - label)^2
    count: Array  # [k] entries with w > 0
    num_outputs: int = struct.field(pytree_node=False, default=1)
    JITTABLE: ClassVar[bool] = True

    @classmethod
    def empty(cls, num_outputs: int = 1):
        if num_outputs < 1:
            raise ValueError(f"R2: num_outputs must be >= 1, got {num_outputs}")
        return cls(*(zeros(np.float32, (num_outputs,)) for _ in range(5)),
                   num_outputs=num_outputs)

    def update(self, **batch):
        preds, labels, weights = _regression_batch(self, batch)
        k = self.num_outputs
        last = labels.shape[-1] if labels.ndim > 1 else 1
        if last != k:
            raise ValueError(f"R2(num_outputs={k}): labels {tuple(labels.shape)}: their last "
                             f"axis holds the outputs; R2.empty(num_outputs={last}) scores "
                             f"{last} outputs, flattened labels one")
        y, p, w = (a.reshape(-1, k) for a in (labels, preds, weights))
        n = jnp.sum(w, axis=0, dtype=jnp.float32)
        mean = weighted_sum(y, w, axis=0) / jnp.where(n > 0, n, 1.0)
        dy = jnp.where(w > 0, y - mean, 0.0)
        part = self.replace(n=n, mean=mean, m2=jnp.sum(w * dy * dy, axis=0),
                            sse=weighted_sum(jnp.square(p - y), w, axis=0),
                            count=jnp.sum(w > 0, axis=0, dtype=jnp.float32))
        return self.merge(part)

    def merge(self, other):
        check_mergeable(self, other)
        xp, a, b = merge_operands(self, other)
        n = a.n + b.n
        frac = b.n / xp.where(n > 0, n, 1.0)  # weight of b in the merged mean
        d = b.mean - a.mean
        return self.replace(n=n, mean=a.mean + d * frac, m2=a.m2 + b.m2 + d * d * a.n * frac,
                            sse=a.sse + b.sse, count=a.count + b.count)

    def compute(self) -> float:
        count, sst, sse = (to_host(v).reshape(-1) for v in (self.count, self.m2, self.sse))
        defined = count >= 2
        if not defined.any():
            return math.nan
        constant = (sse == 0.0).astype(np.float64)  # constant labels: sklearn's force_finite
        per_output = np.where(sst > 0, 1.0 - sse / np.where(sst > 0, sst, 1.0), constant)
        return float(np.mean(per_output[defined]))


@struct.dataclass
class Pearson:
    """Pearson correlation of preds and labels from merged moments, each pair weighing its
    mask (nan for fewer than 2 pairs or constant values).

    Attributes:
        moments: the merged `Moments` of (preds, labels).

    Examples:
        ```python
        import jax.numpy as jnp
        from jtrain import metrics

        preds, labels = jnp.array([1.0, 2.0, 3.0, 5.0]), jnp.array([1.0, 2.0, 4.0, 4.0])
        metrics.Pearson.empty().update(preds=preds, labels=labels).compute()   # 0.8783
        ```
    """
    moments: Moments
    JITTABLE: ClassVar[bool] = True

    @classmethod
    def empty(cls):
        return cls(moments=Moments.empty())

    def update(self, **batch):
        return self.merge(Pearson(moments=Moments.of_batch(*_regression_batch(self, batch))))

    def merge(self, other):
        check_mergeable(self, other)
        return Pearson(moments=self.moments.merge(other.moments))

    def compute(self) -> float:
        m = jax.tree.map(to_host, self.moments)
        if m.count < 2 or m.m2x <= 0 or m.m2y <= 0:
            return math.nan
        return float(np.clip(m.cxy / np.sqrt(m.m2x * m.m2y), -1.0, 1.0))
