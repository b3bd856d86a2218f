"""The pure train and eval steps. No config reads, no I/O: everything static is bound
with functools.partial / closures by `make_*` before `jax.jit`.

Gradient accumulation happens here, not in optax.MultiSteps: one call of train_step is
one optimizer update, and microbatch losses are summed token-weighted, so k
microbatches give the same update as the full batch (MultiSteps averages per-microbatch
means, which is not the same for masked LM losses).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from jtrain import losses
from jtrain import metrics as metrics_lib
from jtrain import precision
from jtrain.state import TrainState


def _split_microbatches(batch, k: int):
    """[B, ...] -> [k, B/k, ...] where microbatch j holds rows j, j+k, j+2k, ...

    Strided (not contiguous) so that each device's rows stay on that device: the batch
    axis is sharded in contiguous blocks, and a block of B/D rows reshaped to
    [B/(D k), k] keeps every microbatch's rows local."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1),
                        batch)


def make_train_step(apply_fn: Callable, loss_fn: Callable, tx: optax.GradientTransformation,
                    schedule: Callable, *, grad_accum_steps: int = 1,
                    dynamic_loss_scale: bool = False) -> Callable:
    """Returns train_step(state, batch) -> (state, metrics). Jit it with shardings."""

    def loss_and_aux(params, batch, key, scale):
        outputs = apply_fn(params, batch["inputs"], rng=key, train=True)
        loss_sum, weight = losses.as_sum_and_weight(loss_fn(outputs, batch))
        return loss_sum * scale, (loss_sum, weight)

    grad_fn = jax.grad(loss_and_aux, has_aux=True)

    def gradients(params, batch, key, scale):
        if grad_accum_steps == 1:
            return grad_fn(params, batch, key, scale)

        def body(carry, xs):
            micro, j = xs
            g, (l, w) = grad_fn(params, micro, jax.random.fold_in(key, j), scale)
            acc_g, acc_l, acc_w = carry
            return (jax.tree.map(jnp.add, acc_g, g), acc_l + l, acc_w + w), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        init = (zeros, jnp.float32(0), jnp.float32(0))
        xs = (_split_microbatches(batch, grad_accum_steps), jnp.arange(grad_accum_steps))
        (g, l, w), _ = jax.lax.scan(body, init, xs)
        g = jax.tree.map(lambda a, p: a.astype(p.dtype), g, params)
        return g, (l, w)

    def train_step(state: TrainState, batch):
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        scale = state.loss_scale["scale"]
        grads, (loss_sum, weight) = gradients(state.params, batch, key, scale)
        denom = jnp.maximum(weight, 1e-12) * scale
        grads = jax.tree.map(lambda g: (g.astype(jnp.float32) / denom).astype(g.dtype), grads)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm)

        def apply(_):
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            return optax.apply_updates(state.params, updates), opt_state

        def skip(_):
            return state.params, state.opt_state

        params, opt_state = jax.lax.cond(finite, apply, skip, None)
        new_state = state.replace(
            step=state.step + 1,  # batches consumed; skipped updates are counted below
            params=params, opt_state=opt_state,
            loss_scale=precision.update_loss_scale(state.loss_scale, finite, dynamic_loss_scale),
            skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32))
        metrics = {
            "train/loss": loss_sum / jnp.maximum(weight, 1e-12),
            "train/grad_norm": grad_norm,
            "train/lr": jnp.asarray(schedule(state.step), jnp.float32),
            "train/tokens": weight,
            "train/skipped_steps": new_state.skipped_steps,
        }
        if dynamic_loss_scale:
            metrics["train/loss_scale"] = new_state.loss_scale["scale"]
        return new_state, metrics

    return train_step


def make_eval_step(apply_fn: Callable, loss_fn: Callable, *, user_loss: bool,
                   metrics: metrics_lib.EvalSpec | None = None) -> Callable:
    """Returns eval_step(params, batch) -> sums {loss_sum, weight[, correct, counted]}, or
    with `metrics` (a jtrain.metrics.EvalSpec) -> (state, inputs): the jittable metric
    states of this batch (a MetricCollection; merge them on the host in float64) and,
    when the spec has host-side metrics (AUROC, Spearman), their batch inputs, else {}.

    Rows with mask 0 (padding) contribute nothing. The default loss honours the mask
    itself; a user loss is evaluated one example at a time (vmapped) and masked here,
    so a user loss that returns a mean is still exact under padding."""
    device_metrics = (None if metrics is None
                      else metrics_lib.make_collection(metrics).partition()[0])

    def eval_step(params, batch):
        outputs = apply_fn(params, batch["inputs"], rng=None, train=False)
        if user_loss:
            mask = batch.get("mask", jnp.ones(outputs.shape[0], jnp.float32))

            def one(out, ex):
                ex = jax.tree.map(lambda x: x[None], ex)
                return losses.as_sum_and_weight(loss_fn(out[None], ex))

            rows = {k: v for k, v in batch.items() if k != "mask"}
            ls, ws = jax.vmap(one)(outputs, rows)  # [B], [B]
            keep = mask > 0  # `where`, not a product: a NaN in a padded row must not leak
            sums = {"loss_sum": jnp.where(keep, ls * mask, 0.0).sum(),
                    "weight": jnp.where(keep, ws * mask, 0.0).sum()}
        else:
            loss_sum, weight = losses.default_loss(outputs, batch)
            sums = {"loss_sum": loss_sum, "weight": weight}
        if metrics is not None:
            state = metrics_lib.update_from_outputs(device_metrics, outputs, batch,
                                                    sums["loss_sum"], sums["weight"], metrics)
            return state, (metrics_lib.metric_batch(outputs, batch, metrics)
                           if metrics.gathers else {})
        hits = losses.correct_count(outputs, batch)
        if hits is not None:
            sums["correct"], sums["counted"] = hits
        return sums

    return eval_step
