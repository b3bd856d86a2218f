"""The guard every train step ends in (`jtrain.step`): an update kept only when it is
finite and every row of its batch valid (`row_validity`), the skip / halt counters, the
fp16 loss scale, the metrics' train/<name> names."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jtrain import losses, precision
from jtrain.optim.update import TRAIN_METRICS
from jtrain.state import TrainState
from jtrain.step.evaluation import ENGINE_KEYS

# Bits of the per-step `train/status` the host reads (jtrain.control.decide, .ledger).
BAD_LOSS, BAD_GRADS, INVALID_BATCH, HALTED = 1, 2, 4, 8


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


def guarded_update(state: TrainState, update: Callable, loss, grad_norm, rows_ok, *,
                   dynamic_loss_scale: bool, halt_on_nonfinite: bool, max_consecutive: int):
    """The guard around `update() -> (params, opt_state, ema, model_state)`: (the next
    state, its metrics).

    The update is applied only when the loss and the gradient norm are finite (global
    values: the same decision on every device and process) and every row of the batch is
    valid (`rows_ok` [B]). Otherwise params, optimizer state, the weight EMA, the model's
    state and the schedule's position are untouched, `skipped_steps` counts it, and
    `train/status` says why. Non-finite skips in a row are counted; at `max_consecutive`
    (or at the first one with `halt_on_nonfinite`) the state records `halted_at` and no
    later update is applied, so the host can stop with the params of the last good step
    (fp16 loss-scale overflows are expected and never count; the loss scale moves here)."""
    valid = rows_ok.all()
    bad_loss = valid & ~jnp.isfinite(loss)
    bad_grads = valid & jnp.isfinite(loss) & ~jnp.isfinite(grad_norm)
    running = state.halted_at == 0
    apply_update = running & valid & jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    params, opt_state, ema, model_state = jax.lax.cond(
        apply_update, lambda _: update(),
        lambda _: (state.params, state.opt_state, state.ema, state.model_state), None)
    # fp16: an overflow in the scaled gradients is the loss scale's business.
    counted = bad_loss | (bad_grads & (not dynamic_loss_scale))
    consecutive = jnp.where(counted, state.consecutive_skips + 1,
                            jnp.where(apply_update, 0, state.consecutive_skips))
    halt_now = running & counted & ((consecutive >= max_consecutive) | halt_on_nonfinite)
    halted_at = jnp.where(halt_now, state.step + 1, state.halted_at)
    skipped = state.skipped_steps + (running & ~apply_update).astype(jnp.int32)
    new_state = state.replace(
        step=state.step + 1,  # batches consumed; skipped updates are counted below
        params=params, opt_state=opt_state, ema=ema, model_state=model_state,
        loss_scale=precision.update_loss_scale(
            state.loss_scale, jnp.isfinite(grad_norm) | ~valid, dynamic_loss_scale),
        skipped_steps=skipped, consecutive_skips=consecutive, halted_at=halted_at)
    status = (bad_loss * BAD_LOSS + bad_grads * BAD_GRADS + (~valid) * INVALID_BATCH
              + (halted_at > 0) * HALTED).astype(jnp.int32)
    return new_state, {"train/skipped_steps": skipped, "train/consecutive_skips": consecutive,
                       "train/status": status, "train/rows_ok": rows_ok}


def finisher(view, *, dynamic_loss_scale: bool, halt_on_nonfinite: bool,
             max_consecutive: int) -> Callable:
    """guard(state, new, metrics, rows_ok) -> (state, metrics): an update's result kept
    or not (`guarded_update`), its metrics named train/<name>."""

    def guard(state: TrainState, new, metrics: dict, rows_ok):
        metrics = dict(metrics)
        states = metrics.pop(TRAIN_METRICS, None)
        loss = jnp.asarray(metrics["loss"], jnp.float32)
        if callable(new) and "grad_norm" not in metrics:
            raise TypeError("update returned its new state as a function (applied only "
                            "when the update is kept) without a 'grad_norm' metric to "
                            "decide that by; return the state, or add 'grad_norm'")
        signal = metrics.get("grad_norm", 0.0)
        if not callable(new):  # a state in hand is checked too: a finite norm can still
            finite = jnp.asarray(True)  # step to inf (a division, an optimizer's state)
            for leaf in jax.tree.leaves(new):
                if jnp.issubdtype(leaf.dtype, jnp.inexact):
                    finite = finite & jnp.isfinite(leaf).all()
            signal = jnp.where(finite, signal, jnp.nan)
        new_state, guarded = guarded_update(
            state, lambda: view.put(state, new() if callable(new) else new), loss, signal,
            rows_ok, dynamic_loss_scale=dynamic_loss_scale,
            halt_on_nonfinite=halt_on_nonfinite, max_consecutive=max_consecutive)
        if "tokens" not in metrics:
            metrics["tokens"] = rows_ok.shape[0]
        out = {f"train/{k}": jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
        out.update(guarded)
        if dynamic_loss_scale:
            out["train/loss_scale"] = new_state.loss_scale["scale"]
        if states is not None:
            out[TRAIN_METRICS] = states
        return new_state, out

    return guard
