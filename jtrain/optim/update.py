"""The update's pieces, public from `jtrain.step`: one optimizer update, gradients summed
over microbatches, and the whole update from summed gradients (`update_from_sums`).

Gradient accumulation happens here, not in optax.MultiSteps: one call is one optimizer
update, and microbatch losses are summed token-weighted, so k microbatches give the same
update as the full batch (MultiSteps averages per-microbatch means, which is not the same
for masked LM losses).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jtrain import metrics as metrics_lib
from jtrain import optim


def ema_update(ema, params, rate):
    """One step of the average towards `params` with decay `rate` (a float32 scalar)."""
    def one(e, p):
        if not jnp.issubdtype(e.dtype, jnp.floating):
            return p.astype(e.dtype)
        return e + (1.0 - rate).astype(e.dtype) * (p.astype(e.dtype) - e)
    return jax.tree.map(one, ema, params)


def _split_microbatches(batch, k: int):
    """[B, ...] -> [k, B/k, ...] where microbatch j holds rows j, j+k, j+2k, ...

    Strided (not contiguous) so that each device's rows stay on that device: the batch
    axis is sharded in contiguous blocks, and a block of B/D rows reshaped to
    [B/(D k), k] keeps every microbatch's rows local. The layout is documented
    (docs/guide/schedules.md): a BatchNorm model's statistics depend on it."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1),
                        batch)


def optimizer_update(tx: optax.GradientTransformation, grads, opt_state, params,
                     lr_factor=1.0):
    """(params, opt_state) after one optax update with `lr_factor` (ReduceLROnPlateau's
    factor: `context.lr_factor` in a step of your own) scaling the learning rate: passed
    to a schedule-free optimizer's update, multiplying the updates of any other. What the
    built-in update applies, and what a step of your own can call for each optimizer it
    keeps.

    Examples:
        ```python
        def update(state, batch, rng, context):       # a GAN's generator, say
            grads = jax.grad(g_loss)(state["g"], state["d"], batch, rng)
            g, g_opt = optimizer_update(tx_g, grads, state["g_opt"], state["g"],
                                        context.lr_factor)
            ...
        ```
    """
    if optim.takes_lr_factor(tx):  # schedule-free: the factor scales its base step
        updates, opt_state = tx.update(grads, opt_state, params, lr_factor=lr_factor)
    else:
        updates, opt_state = tx.update(grads, opt_state, params)
        updates = jax.tree.map(lambda u: (u * lr_factor).astype(u.dtype), updates)
    return optax.apply_updates(params, updates), opt_state


def _zero_aux(aux_shape):
    """The accumulator's start: float32 zeros, and metric states empty (zeros in their
    own dtypes: int32 counts stay exact)."""
    def zero(a):
        if isinstance(a, metrics_lib.MetricCollection):
            return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), a)
        return jnp.zeros(a.shape, jnp.float32)
    return jax.tree.map(zero, aux_shape,
                        is_leaf=lambda x: isinstance(x, metrics_lib.MetricCollection))


def _add_aux(a, b):
    """Sums of two microbatches' aux: metric states merge (exact: Chan's formula for the
    moments), the rest add."""
    def add(x, y):
        return x.merge(y) if isinstance(x, metrics_lib.MetricCollection) else x + y
    return jax.tree.map(add, a, b, is_leaf=lambda x: isinstance(x, metrics_lib.MetricCollection))


def accumulated(value_and_grad: Callable, k: int, *, carry: bool = False) -> Callable:
    """`value_and_grad(params, batch, key, scale) -> ((value, aux), grads)` summed over k
    microbatches (`_split_microbatches`), as (aux, grads): the loss sum, the weight and
    the named terms' (sum, weight) are sums, so dividing by the summed weight gives the
    full batch's token-weighted mean whatever each microbatch weighs. Microbatch j draws
    its randomness from fold_in(key, j).

    With `carry`: `value_and_grad(params, batch, key, scale, c) -> ((value, (aux, c')),
    grads)` and the result is (aux, grads, c), the carry passed from each microbatch to
    the next (a model's state: BatchNorm's statistics move once per microbatch).

    Examples:
        ```python
        def loss_and_aux(params, batch, key, scale):  # aux: sums, added up
            loss_sum, weight = losses.default_loss(apply(params, batch["inputs"]), batch)
            return loss_sum * scale, (loss_sum, weight)

        grad_fn = accumulated(jax.value_and_grad(loss_and_aux, has_aux=True), 4)
        (loss_sum, weight), grads = grad_fn(params, batch, key, 1.0)  # 4 microbatches
        ```
    """

    def one(params, batch, key, scale, c=None):
        if carry:
            (_, (aux, c)), grads = value_and_grad(params, batch, key, scale, c)
            return aux, grads, c
        (_, aux), grads = value_and_grad(params, batch, key, scale)
        return aux, grads, None

    if k == 1:
        return one if carry else (lambda *a: one(*a)[:2])

    def summed(params, batch, key, scale, c=None):
        def body(acc, xs):
            micro, j = xs
            acc_aux, acc_g, c = acc
            aux, g, c = one(params, micro, jax.random.fold_in(key, j), scale, c)
            return (_add_aux(acc_aux, aux), jax.tree.map(jnp.add, acc_g, g), c), None

        splits = _split_microbatches(batch, k)
        first = jax.tree.map(lambda x: x[0], splits)
        aux_shape = jax.eval_shape(lambda: one(params, first, key, scale, c)[0])
        init = (_zero_aux(aux_shape),
                jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params), c)
        (aux, g, c), _ = jax.lax.scan(body, init, (splits, jnp.arange(k)))
        grads = jax.tree.map(lambda a, p: a.astype(p.dtype), g, params)
        return (aux, grads, c) if carry else (aux, grads)

    return summed


# The train step's metric states (log.train_metrics) in its metrics dict: a pytree, not
# a scalar; the loop turns it into train/<name> at log steps.
TRAIN_METRICS = "train_metrics"


class Updated(NamedTuple):
    """The part of the train state the built-in update changes (`update_from_sums`).

    Attributes:
        params: the parameters.
        opt_state: the optax state.
        ema: the weight EMA (None without optim.ema).
        model_state: BatchNorm's statistics and the like (None without).

    Examples:
        ```python
        inner = Updated(state["params"], state["opt"], None, None)  # a step of your own
        ```
    """
    params: Any
    opt_state: Any
    ema: Any
    model_state: Any


def update_from_sums(tx: optax.GradientTransformation, schedule: Callable, inner: Updated,
                     sums, grads, context, ema_rate: Callable | None = None):
    """The built-in update from summed gradients, the one arithmetic of every path (the
    plain step, accumulation, determinism.topology_invariant): -> (applied, metrics).

    `sums` = (loss_sum, weight, {term: (sum, weight)}, train metric states or None);
    `grads` of the summed loss times `context.loss_scale`, any float dtype: divided by
    the weight and the scale in float32, cast to the params' dtypes. `applied()` ->
    `inner` after `optimizer_update` and the EMA (with `ema_rate`), for the guard to run
    when the update is kept; `metrics`: loss, grad_norm, lr, tokens, the terms' means.

    Examples:
        ```python
        applied, metrics = update_from_sums(  # your gradients, the engine's update
            tx, schedule, Updated(params, opt_state, None, None),
            (loss_sum, weight, {}, None), grads, context)  # docs/guide/own-step.md
        ```
    """
    loss_sum, weight, terms, states = sums
    denom = jnp.maximum(weight, 1e-12) * context.loss_scale  # sums -> the weighted mean
    grads = jax.tree.map(lambda g, p: (g.astype(jnp.float32) / denom).astype(p.dtype),
                         grads, inner.params)

    def applied():
        params, opt_state = optimizer_update(tx, grads, inner.opt_state, inner.params,
                                             context.lr_factor)
        ema = inner.ema if ema_rate is None else ema_update(
            inner.ema, params, ema_rate(context.step))  # context.step: updates so far
        return Updated(params, opt_state, ema, inner.model_state)

    metrics = {"loss": loss_sum / jnp.maximum(weight, 1e-12),
               "grad_norm": optax.tree.norm(grads),
               "lr": jnp.asarray(schedule(context.step), jnp.float32) * context.lr_factor,
               "tokens": weight}
    for name, (term_sum, term_weight) in terms.items():  # the loss's named terms
        metrics[name] = term_sum / jnp.maximum(term_weight, 1e-12)
    if states is not None:
        metrics[TRAIN_METRICS] = states
    return applied, metrics
