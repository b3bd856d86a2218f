"""The pure train and eval steps. No config reads, no I/O: everything static is bound
with functools.partial / closures by `make_*` before `jax.jit`.

`train_step` writes the update out (value_and_grad -> tx.update -> optax.apply_updates);
accumulation over microbatches is `accumulated` (from jtrain/optim/update.py, as is
`optimizer_update`), and everything that may hold an update
back (invalid rows, non-finite values, the skip / halt counters, the fp16 loss scale)
is `guarded_update`.

Gradient accumulation happens in the step, not in optax.MultiSteps: one call of train_step is
one optimizer update, and microbatch losses are summed token-weighted, so k
microbatches give the same update as the full batch (MultiSteps averages per-microbatch
means, which is not the same for masked LM losses).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jtrain import invariant
from jtrain import losses
from jtrain import metrics as metrics_lib
from jtrain import precision
from jtrain.optim.update import (TRAIN_METRICS, Updated, accumulated, optimizer_update,
                                 update_from_sums)
from jtrain.state import TrainState, Variables, ema_rate_fn

__all__ = ["Context", "Step", "Updated", "accumulated", "make_eval_step", "make_step_train",
           "make_train_step", "optimizer_update", "update_from_sums"]


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

    The update is applied through `guarded_update`: only when the loss and the gradient
    norm are finite and every row of the batch is valid (`row_validity`); it also keeps
    the skip / halt counters and the fp16 loss scale. `state.lr_factor`
    (ReduceLROnPlateau) scales the whole update, i.e. the learning rate, without a
    recompile. With `ema_decay` > 0 (optim.ema; the state was made with one) the weight
    EMA moves towards the new params after each applied update (`jtrain.state`).
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

    guard = _finisher(BUILT_IN_VIEW, dynamic_loss_scale=dynamic_loss_scale,
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


def make_eval_step(apply_fn: Callable, loss_fn: Callable, *, user_loss: bool,
                   metrics: metrics_lib.EvalSpec | None = None, model_inputs: tuple = (),
                   predict_fn: Callable | None = None, batch_loss: bool = False,
                   forward: Callable | None = None) -> Callable:
    """Returns eval_step(params, batch) -> sums {loss_sum, weight[, correct, counted]}, or
    with `metrics` (a jtrain.metrics.EvalSpec) -> (state, inputs, terms): the jittable
    metric states of this batch (a MetricCollection; merge them on the host in float64),
    when the spec has host-side metrics (AUROC, Spearman) their batch inputs, else {},
    and the user loss's named terms {name: (sum, weight)} (`losses.split_loss`).

    Rows with row mask 0 (padding, `losses.ROW_MASK`) contribute nothing. The default
    loss honours the mask itself. A user loss is evaluated one example at a time
    (vmapped) and masked here, so a user loss that returns a mean is still exact under
    padding; with `batch_loss` it is called once on the whole batch (the only way to
    score a loss defined over the batch, such as a correlation): the evaluator gives it
    batches without padding (a partial batch at its true size), and a mean it returns
    counts once per row, so batch means average weighted by their row counts. `predict_fn(outputs,
    batch) -> (predictions, targets[, weights])` is what the metrics compare.
    `forward(params, batch) -> outputs` replaces the model call (a step of your own: its
    `evaluate(state, batch)`, given the batch without the engine's keys).

    Examples:
        ```python
        ev = jax.jit(jtrain.make_eval_step(model_fns.apply, losses.default_loss,
                                           user_loss=False))
        sums = ev(state.params, batch)  # loss_sum / weight, correct / counted
        ```
    """
    device_metrics = (None if metrics is None
                      else metrics_lib.make_collection(metrics).partition()[0])

    def eval_step(params, batch):
        if forward is not None:
            outputs = forward(params, {k: v for k, v in batch.items()
                                       if k not in ENGINE_KEYS})
        else:
            outputs = apply_fn(params, inputs_of(batch, model_inputs), rng=None, train=False)
        terms = {}
        if user_loss and not batch_loss:
            rows_n = losses.batch_rows(batch)
            mask = losses.row_mask(batch)
            mask = jnp.ones(rows_n, jnp.float32) if mask is None else mask
            # Output leaves without the batch axis (a scalar regulariser) go whole to
            # every example: a mean over examples then adds them once, as in training.
            per_row = jax.tree.map(lambda o: jnp.ndim(o) > 0 and o.shape[0] == rows_n,
                                   outputs)

            def one(out, ex):
                ex = jax.tree.map(lambda x: x[None], ex)
                out = jax.tree.map(lambda o, b: o[None] if b else o, out, per_row)
                return losses.split_loss(loss_fn(out, ex))

            rows = {k: v for k, v in batch.items() if k not in ENGINE_KEYS}
            in_axes = (jax.tree.map(lambda b: 0 if b else None, per_row), 0)
            (ls, ws), per_terms = jax.vmap(one, in_axes=in_axes)(outputs, rows)  # [B] each
            keep = mask > 0  # `where`, not a product: a NaN in a padded row must not leak

            def masked(x):
                return jnp.where(keep, x * mask, 0.0).sum()

            sums = {"loss_sum": masked(ls), "weight": masked(ws)}
            terms = {k: (masked(s), masked(w)) for k, (s, w) in per_terms.items()}
        elif user_loss:  # batch scope: a batch without padding (`jtrain.engine.evaluation`)
            (loss_sum, weight), terms = losses.split_loss(loss_fn(outputs, batch),
                                                          rows=losses.batch_rows(batch))
            sums = {"loss_sum": loss_sum, "weight": weight}
        else:
            loss_sum, weight = losses.default_loss(outputs, batch)
            sums = {"loss_sum": loss_sum, "weight": weight}
        if metrics is not None:
            m_outputs, m_batch = metric_view(outputs, batch, predict_fn)
            state = metrics_lib.update_from_outputs(device_metrics, m_outputs, m_batch,
                                                    sums["loss_sum"], sums["weight"], metrics)
            return state, (metrics_lib.metric_batch(m_outputs, m_batch, metrics)
                           if metrics.gathers else {}), terms
        hits = losses.correct_count(outputs, batch)
        if hits is not None:
            sums["correct"], sums["counted"] = hits
        return sums

    return eval_step


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



# -- a step of your own ------------------------------------------------------------------
# Research code brings its update rule as three pure functions (`Step`); the engine keeps
# everything else: the per-step key, the guard (a non-finite loss or state leaves the state
# as it was, counted in the ledger), the counters, sharding, checkpoints and resume, the
# metrics' names, evaluation with jtrain's metrics. The built-in update uses the same
# guard (`guarded_update`), accumulation (`accumulated`) and optax update
# (`optimizer_update`) a step of your own can call.


@dataclasses.dataclass(frozen=True)
class Context:
    """What the engine decides and a step of your own reads (`update`'s `context`).

    Attributes:
        step: int32 [], the updates applied so far (skipped ones not counted).
        lr_factor: float32 [], ReduceLROnPlateau's factor on the learning rate.
        loss_scale: float32 [], fp16's dynamic loss scale (1 otherwise).

    Examples:
        ```python
        def update(state, batch, rng, context):
            lr = 0.1 * context.lr_factor              # follows ReduceLROnPlateau
            ...
        ```
    """
    step: jax.Array
    lr_factor: jax.Array
    loss_scale: Any = 1.0  # a float32 [] array inside the step


jax.tree_util.register_dataclass(Context, data_fields=["step", "lr_factor", "loss_scale"],
                                 meta_fields=[])


class View(NamedTuple):
    """Which part of the TrainState a step owns: `get(state)` -> the step's state,
    `put(state, new)` -> (params, opt_state, ema, model_state) for `guarded_update`.
    Either update gets the batch as the engine holds it: with data.drop_last=False its
    row mask (`losses.ROW_MASK`, 0 = a padding row) marks the padded last batch, which
    a loss weighted by `losses.weights_for` then scores at its true rows."""
    get: Callable
    put: Callable


# A step of your own: its whole state is TrainState.params.
OWN_VIEW = View(get=lambda s: s.params,
                put=lambda s, new: (new, s.opt_state, s.ema, s.model_state))
# The built-in update: params, optimizer state, the weight EMA, the model's state.
BUILT_IN_VIEW = View(get=lambda s: Updated(s.params, s.opt_state, s.ema, s.model_state),
                     put=lambda s, new: tuple(new))


@dataclasses.dataclass(frozen=True)
class Step:
    """A training step of your own, as pure functions (docs/guide/own-step.md).

    `example` is one training example (no batch axis); `batch` a global batch as the
    built-in step gets it; `rng` a fresh key per step (fold_in of the run's key and the
    step). Metrics are logged as train/<name>.

    Attributes:
        init: `init(rng, example) -> state`, any pytree of arrays: several models'
            params, several optimizers' states, a frozen teacher, a target network.
        update: `update(state, batch, rng, context) -> (state, metrics)`, one update; the
            state keeps its structure and dtypes; metrics: scalars, "loss" among them.
            The state may come back as a function `() -> state` with a "grad_norm"
            metric: the engine runs it only when the update is kept.
        evaluate: `evaluate(state, batch) -> outputs`, what jtrain's eval metrics and
            loss score (needed when the run evaluates), or None.
        name: shown in the run's header.

    Examples:
        ```python
        def init(rng, example):
            return {"w": jnp.zeros(3)}

        def update(state, batch, rng, context):
            def loss(w):
                return ((batch["inputs"] @ w - batch["targets"]) ** 2).mean()
            value, grad = jax.value_and_grad(loss)(state["w"])
            return {"w": state["w"] - 0.1 * context.lr_factor * grad}, {"loss": value}

        step = Step(init=init, update=update, evaluate=lambda s, b: b["inputs"] @ s["w"])
        result = jtrain.train({"total_steps": 100}, "runs/own", step=step,
                              train_data=(x, y), eval_data=(x_eval, y_eval))
        ```
    """
    init: Callable[[jax.Array, Any], Any]
    update: Callable[[Any, Any, jax.Array, Context], tuple[Any, dict]]
    evaluate: Callable[[Any, Any], Any] | None = None
    name: str = ""


def make_step_train(step: Step, *, view: View = OWN_VIEW, halt_on_nonfinite: bool = False,
                    max_consecutive: int = 8, valid_fn: Callable | None = None,
                    dynamic_loss_scale: bool = False) -> Callable:
    """train_step(TrainState, batch) -> (TrainState, metrics) around `step.update`, for
    the built-in update and a step of your own alike: the per-step key, the context, and
    the guard. The update is kept only when every row is valid (`row_validity`), the
    "loss" metric is finite and the update is: its "grad_norm" metric when it returns one,
    and every floating leaf of the new state unless that comes as a function (the
    built-in: computed only when kept, so "grad_norm" decides) (`guarded_update`:
    otherwise the state is as it was, `skipped_steps` counts it, `train/status` says
    why). Metrics come back as train/<name>; "tokens" (the batch's real rows when the
    step returns none) feeds tokens/s. In determinism.topology_invariant the engine runs
    it whole on every device (`invariant.Whole`).

    Examples:
        ```python
        train_step = jax.jit(make_step_train(Step(init=init, update=update)))
        state, metrics = train_step(state, batch)   # state.params: the step's state
        ```
    """
    guard = _finisher(view, dynamic_loss_scale=dynamic_loss_scale,
                      halt_on_nonfinite=halt_on_nonfinite, max_consecutive=max_consecutive)

    def train_step(state: TrainState, batch):
        key, context = step_inputs(state)
        new, metrics = step.update(view.get(state), batch, key, context)
        if "tokens" not in metrics and losses.ROW_MASK in batch:  # padding is no example
            metrics = {**metrics, "tokens": batch[losses.ROW_MASK].sum()}
        return guard(state, new, metrics, row_validity(batch, valid_fn))

    return train_step


def step_inputs(state: TrainState):
    """What a step reads besides the batch: the step's key (fold_in of the run's key and
    the step) and its Context."""
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    return key, Context(step=state.step - state.skipped_steps, lr_factor=state.lr_factor,
                        loss_scale=state.loss_scale["scale"])


def _finisher(view: View, *, dynamic_loss_scale: bool, halt_on_nonfinite: bool,
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
