"""Helpers shared by the metric states: host dtypes, exact merging, masks."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = Any


def is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def to_host(x) -> np.ndarray:
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


def merge_operands(a, b):
    """(xp, a, b) for merging two metric states: jnp and the states as they are under
    jit, else numpy and both states in the host dtypes (float64 / int64)."""
    if any(is_tracer(x) for x in jax.tree.leaves((a, b))):
        return jnp, a, b
    return np, jax.tree.map(to_host, a), jax.tree.map(to_host, b)


def add_leaves(a, b):
    if is_tracer(a) or is_tracer(b):
        return a + b  # under jit: stays on device, in the device dtype
    return to_host(a) + to_host(b)


def static_options(metric) -> dict[str, Any]:
    return {f.name: getattr(metric, f.name) for f in dataclasses.fields(metric)
            if not f.metadata.get("pytree_node", True)}


def check_mergeable(a, b) -> None:
    if type(a) is not type(b):
        raise TypeError(f"cannot merge {type(a).__name__} with {type(b).__name__}")
    if static_options(a) != static_options(b):
        raise ValueError(f"cannot merge {type(a).__name__} states with different options: "
                         f"{static_options(a)} vs {static_options(b)}")


def sum_merge(a, b):
    check_mergeable(a, b)
    return jax.tree.map(add_leaves, a, b)


def require(batch: dict, key: str, who) -> Array:
    value = batch.get(key)
    if value is None:
        raise KeyError(f"{type(who).__name__}.update needs batch[{key!r}]; got keys "
                       f"{sorted(k for k, v in batch.items() if v is not None)}")
    return value


def broadcast_mask(mask, shape, xp):
    """mask [prefix of shape] -> mask broadcast to shape."""
    mask = xp.asarray(mask)
    if tuple(shape[:mask.ndim]) != tuple(mask.shape):
        raise ValueError(f"mask shape {tuple(mask.shape)} is not a prefix of {tuple(shape)}")
    mask = mask.reshape(mask.shape + (1,) * (len(shape) - mask.ndim))
    return xp.broadcast_to(mask, shape)


def entry_weights(mask, shape) -> jax.Array:
    """float32 [shape]: each entry's weight, the mask's value where it is > 0 and 0 elsewhere
    (padding, and a bool mask's False; a bool mask's True weighs 1)."""
    if mask is None:
        return jnp.ones(shape, jnp.float32)
    mask = broadcast_mask(mask, shape, jnp)
    if mask.dtype == jnp.bool_:
        return mask.astype(jnp.float32)
    return jnp.where(mask > 0, mask.astype(jnp.float32), 0.0)


def weighted_sum(values, weights, axis=None) -> jax.Array:
    """sum(weights * values) over the entries that weigh; a zero-weight entry's value (NaN
    in a padded row) is never multiplied in."""
    return jnp.sum(jnp.where(weights > 0, values * weights, 0.0), axis=axis, dtype=jnp.float32)


def class_predictions(batch: dict, who) -> jax.Array:
    if batch.get("logits") is not None:
        return jnp.argmax(jnp.asarray(batch["logits"]), axis=-1)
    return jnp.asarray(require(batch, "preds", who))


def ratio(num, den) -> float:
    num, den = to_host(num), to_host(den)
    return float(num / den) if den > 0 else math.nan


def zeros(dtype, shape=()) -> np.ndarray:
    return np.zeros(shape, dtype)
