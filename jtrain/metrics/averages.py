"""Weighted means: loss, perplexity, bits per byte."""

from __future__ import annotations

import math
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
from flax import struct

from jtrain.metrics.base import Array, entry_weights, ratio, require, sum_merge, zeros


@struct.dataclass
class Average:
    """Weighted mean of ``batch[key]`` (per example [B] or per token [B, T]).

    A float mask is a weight (0 = padding). compute() -> float (nan when nothing was seen).

    Attributes:
        total: the weighted sum of the values (float32 on device, float64 merged).
        count: the sum of the weights.
        key: the batch key averaged (static).

    Examples:
        ```python
        import jax.numpy as jnp
        from jtrain import metrics

        m = metrics.Average.empty().update(values=jnp.array([1.0, 2.0, 6.0]))
        m.compute()                                               # 3.0
        m = metrics.Average.empty().update(values=jnp.array([1.0, 2.0, 6.0]),
                                           mask=jnp.array([1.0, 1.0, 0.0]))
        m.compute()                                               # 1.5: the padding left out
        ```
    """
    total: Array    # float32 on device, float64 after a host merge
    count: Array    # sum of weights
    key: str = struct.field(pytree_node=False, default="values")
    JITTABLE: ClassVar[bool] = True

    @classmethod
    def empty(cls, key: str = "values"):
        return cls(total=zeros(np.float32), count=zeros(np.float32), key=key)

    def update(self, **batch):
        values = jnp.asarray(require(batch, self.key, self), jnp.float32)
        weight = entry_weights(batch.get("mask"), values.shape)
        part = self.replace(
            total=jnp.sum(jnp.where(weight > 0, values * weight, 0.0)),
            count=jnp.sum(weight))
        return self.merge(part)

    def merge(self, other):
        return sum_merge(self, other)

    def mean(self) -> float:
        return ratio(self.total, self.count)

    def compute(self) -> float:
        return self.mean()


@struct.dataclass
class Loss(Average):
    """Average of ``batch["loss"]``.

    Its fields are those of `Average`.

    Examples:
        ```python
        import jax.numpy as jnp
        from jtrain import metrics

        metrics.Loss.empty().update(loss=jnp.array([0.5, 1.5])).compute()   # 1.0
        ```
    """

    @classmethod
    def empty(cls, key: str = "loss"):
        return super().empty(key=key)


@struct.dataclass
class Perplexity(Average):
    """exp(mean token cross-entropy in nats), from ``batch["loss"]`` (per token) and mask.

    Its fields are those of `Average`.

    Examples:
        ```python
        import jax.numpy as jnp
        from jtrain import metrics

        metrics.Perplexity.empty().update(loss=jnp.array([[0.5, 1.5]])).compute()   # e = 2.718
        ```
    """

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
    """mean cross-entropy (nats per byte) / ln 2, for byte-level language models.

    Its fields are those of `Average`.

    Examples:
        ```python
        import jax.numpy as jnp
        from jtrain import metrics

        metrics.BitsPerByte.empty().update(loss=jnp.array([0.6931472])).compute()   # 1.0
        ```
    """

    @classmethod
    def empty(cls, key: str = "loss"):
        return super().empty(key=key)

    def compute(self) -> float:
        return self.mean() / math.log(2.0)
