"""Loss functions. A loss returns `(loss_sum, weight_sum)` so that averaging over
microbatches, devices and hosts is exact (token-weighted); a plain scalar (a mean) is
also accepted from user losses and then counts with weight 1.

Batch conventions (numpy dicts from jtrain.data):
  inputs   model input
  targets  int labels -> softmax cross-entropy over the last output axis;
           float targets -> mean squared error
  weights  optional per-example or per-token loss weights (e.g. an LM's loss mask)
  mask     optional [B] validity of rows (0 = padding added by the eval pipeline)
"""

from __future__ import annotations

import jax.numpy as jnp
import optax


def weights_for(batch, shape) -> jnp.ndarray:
    """Per-element weights of shape `shape`: `weights` times the row `mask`."""
    w = jnp.ones(shape, jnp.float32)
    if "weights" in batch:
        w = w * jnp.broadcast_to(_expand(batch["weights"], len(shape)), shape)
    if "mask" in batch:
        w = w * _expand(batch["mask"], len(shape))
    return w


def _expand(x, ndim):
    x = jnp.asarray(x, jnp.float32)
    return x.reshape(x.shape + (1,) * (ndim - x.ndim))


def per_example_loss(outputs, targets) -> jnp.ndarray:
    """Cross-entropy for integer targets ([B] or [B, T]); squared error, averaged over
    the trailing feature axes, for float targets."""
    outputs = outputs.astype(jnp.float32)
    if jnp.issubdtype(targets.dtype, jnp.integer):
        return optax.softmax_cross_entropy_with_integer_labels(outputs, targets)
    diff = (outputs - targets.astype(jnp.float32)) ** 2  # [B, ...]
    return diff.reshape(diff.shape[0], -1).mean(axis=1)  # [B]


def default_loss(outputs, batch):
    """Weighted sum of per-example (or per-token) losses, and the sum of weights."""
    per = per_example_loss(outputs, batch["targets"])
    w = weights_for(batch, per.shape)
    return (per * w).sum(), w.sum()


def as_sum_and_weight(result):
    """Normalise a loss function's result to (loss_sum, weight_sum)."""
    if isinstance(result, tuple):
        loss_sum, weight = result
        return jnp.asarray(loss_sum, jnp.float32), jnp.asarray(weight, jnp.float32)
    return jnp.asarray(result, jnp.float32), jnp.asarray(1.0, jnp.float32)


def correct_count(outputs, batch):
    """(number correct, number counted) for classification-shaped outputs, else None."""
    targets = batch["targets"]
    if not jnp.issubdtype(targets.dtype, jnp.integer) or outputs.ndim != targets.ndim + 1:
        return None
    hits = (jnp.argmax(outputs, axis=-1) == targets).astype(jnp.float32)
    w = weights_for(batch, hits.shape)
    return (hits * w).sum(), w.sum()
