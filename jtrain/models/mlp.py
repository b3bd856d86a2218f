"""MLP classifier / regressor: flatten -> [Dense -> activation -> dropout] * n -> Dense.

Precision: kernels and biases are stored in `param_dtype`, matmuls run in `dtype`, the
outputs are float32.

Logical axes (names from `jtrain.mesh.LOGICAL_RULES`): hidden kernels alternate between
("embed", "mlp") and ("mlp", "embed") so consecutive layers shard on alternating mesh
axes; each bias takes its kernel's output name; the output kernel is (<in>, "classes")
with bias ("classes",).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn


ACTIVATIONS = {"gelu": nn.gelu, "relu": nn.relu, "silu": nn.silu, "tanh": jnp.tanh}

Dtype = Any


class MLP(nn.Module):
    hidden: Sequence[int]
    num_outputs: int
    dropout: float
    activation: str
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        """x float [B, ...] -> float32 [B, num_outputs]."""
        x = x.reshape(x.shape[0], -1).astype(self.dtype)  # [B, F]
        act = ACTIVATIONS[self.activation]
        axis_names = ("embed", "mlp")
        for i, width in enumerate(self.hidden):
            in_axis, out_axis = axis_names[i % 2], axis_names[(i + 1) % 2]
            x = self._dense(f"dense_{i}", x, width, (in_axis, out_axis))  # [B, H_i]
            x = act(x)
            if train and self.dropout > 0:
                x = nn.Dropout(self.dropout, deterministic=False)(x)  # "dropout" rng
        in_axis = axis_names[len(self.hidden) % 2]
        x = self._dense("out", x, self.num_outputs, (in_axis, "classes"))  # [B, O]
        return x.astype(jnp.float32)

    def _dense(self, name: str, x: jax.Array, features: int, axes) -> jax.Array:
        return nn.Dense(
            features, dtype=self.dtype, param_dtype=self.param_dtype, name=name,
            kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), axes),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (axes[1],)))(x)


def build(model_cfg, *, dtype, param_dtype) -> MLP:
    """An MLP from a validated `model` section (jtrain.config.resolve_model)."""
    c = model_cfg
    return MLP(hidden=tuple(int(h) for h in c["hidden"]), num_outputs=int(c["num_outputs"]),
               dropout=float(c["dropout"]), activation=c["activation"],
               dtype=dtype, param_dtype=param_dtype)


def num_params(model_cfg, input_shape) -> int:
    """Kernels plus biases for one example of shape `input_shape` (no batch axis)."""
    c = model_cfg
    widths = [math.prod(int(s) for s in input_shape), *c["hidden"], c["num_outputs"]]
    return int(sum(a * b + b for a, b in zip(widths[:-1], widths[1:], strict=True)))


def flops_per_example(model_cfg, input_shape) -> float:
    """Training FLOPs (forward + backward) for one example: 6 * parameters.

    `input_shape` is one example's shape without the batch axis; it is flattened.
    """
    return float(6 * num_params(model_cfg, input_shape))
