"""A step of your own: research code brings its update rule as pure functions (`Step`);
the engine keeps the rest (the per-step key, the guard, the counters, sharding,
checkpoints, metrics' names, evaluation) in `make_step_train`, which wraps the built-in
update too."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax

from jtrain import losses
from jtrain.optim.update import Updated
from jtrain.state import TrainState
from jtrain.step.guard import finisher, row_validity

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
    guard = finisher(view, dynamic_loss_scale=dynamic_loss_scale,
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
