"""What a step reads of a batch: the model's inputs, each row's validity, the view the
metrics compare (`jtrain.step`)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jtrain import losses

ENGINE_KEYS = (losses.ROW_MASK,)


def inputs_of(batch, model_inputs: tuple = ()):
    """What the model is called with: the `model_inputs` fields of the batch (one: that
    array; several: a dict of them), else `batch["inputs"]`, else the whole batch less
    the engine's row mask (a dataset yielding `x_data`, `x_avail`, ... needs no
    restructuring). Works on one example as on a batch."""
    if model_inputs:
        missing = [k for k in model_inputs if k not in batch]
        if missing:
            raise KeyError(f"data.model_inputs: no field {missing[0]!r} in the batch "
                           f"(fields: {', '.join(sorted(map(str, batch)))})")
        if len(model_inputs) == 1:
            return batch[model_inputs[0]]
        return {k: batch[k] for k in model_inputs}
    if "inputs" in batch:
        return batch["inputs"]
    return {k: v for k, v in batch.items() if k not in ENGINE_KEYS}



def row_validity(batch, valid_fn: Callable | None = None):
    """[B] bool: a row is valid when every floating value of its fields is finite (a
    `targets` element under weight 0 is a missing value, exempt: the losses select it
    out) and `valid_fn(batch)` (data.valid_fn: a scalar for the whole batch, or [B]) is
    true. No field name has a meaning of its own here: a `valid` or `mask` field is the
    user's data."""
    rows = None
    for key, leaf in _floating_leaves(batch):
        finite = jnp.isfinite(leaf)
        if key == "targets" and "weights" in batch:
            finite = finite | (losses.weights_for(batch, leaf.shape) == 0)
        ok = finite.reshape(leaf.shape[0], -1).all(axis=1)
        rows = ok if rows is None else rows & ok
    n = jax.tree.leaves(batch)[0].shape[0]
    rows = jnp.ones((n,), bool) if rows is None else rows
    if valid_fn is not None:
        user = jnp.asarray(valid_fn(batch)).astype(bool)
        rows = rows & (jnp.broadcast_to(user, (n,)) if user.ndim == 0 else user.reshape(n))
    return rows


def _floating_leaves(batch):
    for key in batch:
        if key in ENGINE_KEYS:
            continue
        for leaf in jax.tree.leaves(batch[key]):
            if jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.ndim >= 1:
                yield key, leaf


def metric_view(outputs, batch, predict_fn: Callable | None = None):
    """(predictions, batch) the metrics read: the outputs and the batch as they are, or
    `predict_fn`'s predictions with its targets (and weights, if it returns them) in
    place of the batch's."""
    if predict_fn is None:
        return outputs, batch
    result = predict_fn(outputs, batch)
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise TypeError("eval.predict_fn: must return (predictions, targets) or "
                        f"(predictions, targets, weights), got {type(result).__name__}")
    view = {"targets": result[1]}
    if len(result) == 3:
        view["weights"] = result[2]
    rows = losses.row_mask(batch)
    if rows is not None:
        view[losses.ROW_MASK] = rows
    return result[0], view
