"""The pure train and eval steps. No config reads, no I/O: everything static is bound
with functools.partial / closures by `make_*` before `jax.jit`.

One update, whatever the path: `make_train_step`'s gradients (summed over microbatches
by `accumulated`, over chunks by determinism.topology_invariant) become the new state in
`update_from_sums` (jtrain/optim/update.py), kept or not by the guard (guard.py). Here:
the built-in update and its invariant form; own.py: a step of your own (`Step`) and the
wrapper every update runs in; evaluation.py: the eval step and the model's inputs.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from jtrain import invariant
from jtrain import losses
from jtrain import metrics as metrics_lib
from jtrain.optim.update import TRAIN_METRICS  # noqa: F401
from jtrain.optim.update import Updated, accumulated, optimizer_update, update_from_sums
from jtrain.state import Variables, ema_rate_fn
# The engine and the control floor read the parts' names from here too.
from jtrain.step.evaluation import ENGINE_KEYS, inputs_of, make_eval_step  # noqa: F401
from jtrain.step.evaluation import metric_view  # noqa: F401
from jtrain.step.guard import BAD_GRADS, BAD_LOSS, HALTED, INVALID_BATCH  # noqa: F401
from jtrain.step.guard import finisher, guarded_update, row_validity  # noqa: F401
from jtrain.step.own import BUILT_IN_VIEW, OWN_VIEW, Context, Step, View  # noqa: F401
from jtrain.step.own import make_step_train, step_inputs

__all__ = ["Context", "Step", "Updated", "accumulated", "make_eval_step", "make_step_train",
           "make_train_step", "optimizer_update", "update_from_sums"]


def make_train_step(apply_fn: Callable, loss_fn: Callable, tx: optax.GradientTransformation,
                    schedule: Callable, *, grad_accum_steps: int = 1,
                    dynamic_loss_scale: bool = False, halt_on_nonfinite: bool = False,
                    max_consecutive: int = 8, valid_fn: Callable | None = None,
                    model_inputs: tuple = (), ema_decay: float = 0.0,
                    ema_warmup: str = "none",
                    train_metrics: metrics_lib.EvalSpec | None = None,
                    predict_fn: Callable | None = None,
                    invariant: tuple | None = None) -> Callable:
    """Returns train_step(state, batch) -> (state, metrics). Jit it with shardings.

    The update is `update_from_sums` (`state.lr_factor` scales it without a recompile;
    with `ema_decay` > 0 the weight EMA follows), applied through `guarded_update` only
    when it is finite and every row of the batch is valid (`row_validity`).
    `train_metrics` (log.train_metrics, an EvalSpec): their metric states of this batch,
    from the training forward's outputs (through `predict_fn`, as eval does), merged
    exactly over microbatches, come back as `metrics[TRAIN_METRICS]`
    (`train_metric_values` turns them into train/<name>). `invariant` = (mesh, chunks,
    the state's shardings): determinism.topology_invariant's update, the same bits on
    any number of devices; the step is then an `invariant.SplitStep` (programs for one
    device dispatched on each device), not to be jitted.

    Examples:
        ```python
        step = jax.jit(jtrain.make_train_step(model_fns.apply, losses.default_loss, tx,
                                              schedule))  # the rest: make_abstract_state
        state, metrics = step(state, jtrain.host_to_device(batch, mesh))
        ```
    """

    def loss_and_aux(params, batch, key, scale, model_state):
        inputs = inputs_of(batch, model_inputs)
        if model_state is None:
            outputs = apply_fn(params, inputs, rng=key, train=True)
        else:  # the model's state (BatchNorm statistics) moves with this batch
            outputs, new_model_state = apply_fn(Variables(params, model_state), inputs,
                                                rng=key, train=True, mutable=True)
            model_state = jax.tree.map(lambda n, o: n.astype(o.dtype), new_model_state,
                                       model_state)
        (loss_sum, weight), terms = losses.split_loss(loss_fn(outputs, batch))
        states = None if train_metrics is None else _metric_states(
            train_metrics, predict_fn, *jax.lax.stop_gradient((outputs, batch, loss_sum,
                                                               weight)))
        return loss_sum * scale, ((loss_sum, weight, terms, states),
                                  jax.lax.stop_gradient(model_state))

    ema_rate = ema_rate_fn(ema_decay, ema_warmup)
    value_and_grad = accumulated(jax.value_and_grad(loss_and_aux, has_aux=True),
                                 grad_accum_steps, carry=True)

    def update(inner: Updated, batch, key, context: Context):
        """The built-in update as a step's `update`: the token-weighted gradient
        (`accumulated` over microbatches) turned into the new state by
        `update_from_sums`, the model's state after this batch."""
        sums, grads, model_state = value_and_grad(inner.params, batch, key,
                                                  context.loss_scale, inner.model_state)
        return update_from_sums(tx, schedule, inner._replace(model_state=model_state),
                                sums, grads, context, ema_rate)

    guard = finisher(BUILT_IN_VIEW, dynamic_loss_scale=dynamic_loss_scale,
                     halt_on_nonfinite=halt_on_nonfinite, max_consecutive=max_consecutive)
    if invariant is not None:
        return _invariant_step(jax.value_and_grad(loss_and_aux, has_aux=True), tx, schedule,
                               ema_rate, grad_accum_steps, guard, valid_fn, *invariant)
    return make_step_train(Step(init=_engine_init, update=update, name="built-in"),
                           view=BUILT_IN_VIEW, valid_fn=valid_fn,
                           dynamic_loss_scale=dynamic_loss_scale,
                           halt_on_nonfinite=halt_on_nonfinite,
                           max_consecutive=max_consecutive)


def _invariant_step(value_and_grad, tx, schedule, ema_rate, grad_accum_steps, guard,
                    valid_fn, mesh, k, state_shardings):
    """The built-in update with every cross-device sum in a fixed order, as two programs
    compiled for one device (`invariant.SplitStep`): each of the k chunks' sums and
    gradients (`accumulated` over its microbatches) on the device that holds it; then,
    on every device, the k results added in `invariant.tree_sum`'s order and the update
    on whole arrays inside the guard."""
    one = accumulated(value_and_grad, grad_accum_steps, carry=True)

    def per_chunk(inner, scale, chunk, key):
        aux, grads, model_state = one(inner.params, chunk, key, scale, inner.model_state)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        # The model's state after the batch: the mean of the chunks' states.
        model_state = jax.tree.map(lambda m: m / k if jnp.issubdtype(m.dtype, jnp.inexact)
                                   else m // k, model_state)
        return aux, grads, model_state

    def first(state, rows, ids):
        key, context = step_inputs(state)
        inner = BUILT_IN_VIEW.get(state)
        return invariant.each_chunk(lambda shared, xs: per_chunk(*shared, *xs),
                                    (inner, context.loss_scale),
                                    (invariant.chunked(rows, ids.shape[0]),
                                     invariant.chunk_keys(key, ids)), ids)

    def second(state, stacked, rows_ok):
        _, context = step_inputs(state)
        inner = BUILT_IN_VIEW.get(state)
        sums, grads, model_state = invariant.sum_stacked(stacked, k)
        model_state = jax.tree.map(lambda n, o: n.astype(o.dtype), model_state,
                                   inner.model_state)
        applied, metrics = update_from_sums(tx, schedule, inner._replace(
            model_state=model_state), sums, grads, context, ema_rate)
        return guard(state, applied, metrics, rows_ok)

    return invariant.SplitStep(first, second, lambda batch: row_validity(batch, valid_fn),
                               mesh, k, state_shardings)


def _engine_init(rng, example):
    raise NotImplementedError("the built-in update's state is made by "
                              "jtrain.state.init_state (sharded by the model's annotations)")


def _metric_states(spec, predict_fn, outputs, batch, loss_sum, weight):
    """One (micro)batch's metric states: the eval definitions (`jtrain.metrics`) on the
    training forward's outputs."""
    m_outputs, m_batch = metric_view(outputs, batch, predict_fn)
    return metrics_lib.update_from_outputs(metrics_lib.make_collection(spec), m_outputs,
                                           m_batch, loss_sum, weight, spec)


def train_metric_values(states) -> dict[str, float]:
    """Fetched metric states -> {"train/<name>": value} (host side, float64)."""
    return {f"train/{k}": v for k, v in states.compute().items()}
