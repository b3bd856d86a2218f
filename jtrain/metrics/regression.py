"""Regression: float ``preds`` vs ``labels`` (any shape, flattened; mask a prefix of it)."""

from __future__ import annotations

import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jtrain.metrics.base import (Array, add_leaves, check_mergeable, is_tracer, masked_sum,
                                 ratio, require, sum_merge, to_host, valid_mask, zeros)


@struct.dataclass
class MSE:
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
        valid = valid_mask(batch.get("mask"), labels.shape)
        return self.merge(self.replace(total=masked_sum(self._error(preds, labels), valid),
                                       count=jnp.sum(valid, dtype=jnp.float32)))

    def merge(self, other):
        return sum_merge(self, other)

    def compute(self) -> float:
        return ratio(self.total, self.count)


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
        return cls(*(zeros(np.float32) for _ in range(6)))

    @classmethod
    def of_batch(cls, x, y, valid):
        n = jnp.sum(valid, dtype=jnp.float32)
        safe_n = jnp.maximum(n, 1.0)
        mean_x = masked_sum(x, valid) / safe_n
        mean_y = masked_sum(y, valid) / safe_n
        dx = jnp.where(valid, x - mean_x, 0.0)
        dy = jnp.where(valid, y - mean_y, 0.0)
        return cls(n=n, mean_x=mean_x, mean_y=mean_y, m2x=jnp.sum(dx * dx),
                   m2y=jnp.sum(dy * dy), cxy=jnp.sum(dx * dy))

    def merge(self, other):
        if any(is_tracer(x) for x in jax.tree.leaves((self, other))):
            xp, a, b = jnp, self, other
        else:
            xp, a, b = np, jax.tree.map(to_host, self), jax.tree.map(to_host, other)
        n = a.n + b.n
        frac = b.n / xp.where(n > 0, n, 1.0)    # weight of b in the merged mean
        cross = a.n * frac                       # = na * nb / n
        dx, dy = b.mean_x - a.mean_x, b.mean_y - a.mean_y
        return Moments(n=n, mean_x=a.mean_x + dx * frac, mean_y=a.mean_y + dy * frac,
                       m2x=a.m2x + b.m2x + dx * dx * cross,
                       m2y=a.m2y + b.m2y + dy * dy * cross,
                       cxy=a.cxy + b.cxy + dx * dy * cross)


def _regression_batch(metric, batch):
    preds = jnp.asarray(require(batch, "preds", metric), jnp.float32)
    labels = jnp.asarray(require(batch, "labels", metric), jnp.float32)
    return preds, labels, valid_mask(batch.get("mask"), labels.shape)


@struct.dataclass
class R2:
    """Coefficient of determination, pooled over all entries (sklearn's r2_score on the
    flattened arrays): nan for n < 2; 1.0 / 0.0 for constant labels (force_finite)."""
    moments: Moments
    sse: Array
    JITTABLE: ClassVar[bool] = True

    @classmethod
    def empty(cls):
        return cls(moments=Moments.empty(), sse=zeros(np.float32))

    def update(self, **batch):
        preds, labels, valid = _regression_batch(self, batch)
        part = R2(moments=Moments.of_batch(preds, labels, valid),
                  sse=masked_sum(jnp.square(preds - labels), valid))
        return self.merge(part)

    def merge(self, other):
        check_mergeable(self, other)
        return R2(moments=self.moments.merge(other.moments), sse=add_leaves(self.sse, other.sse))

    def compute(self) -> float:
        n, sst, sse = (float(to_host(v)) for v in (self.moments.n, self.moments.m2y, self.sse))
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
        check_mergeable(self, other)
        return Pearson(moments=self.moments.merge(other.moments))

    def compute(self) -> float:
        m = jax.tree.map(to_host, self.moments)
        if m.n < 2 or m.m2x <= 0 or m.m2y <= 0:
            return math.nan
        return float(np.clip(m.cxy / np.sqrt(m.m2x * m.m2y), -1.0, 1.0))
