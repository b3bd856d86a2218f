"""A step of your own (`jtrain.step.Step`: init, update, evaluate) in the engine: `build`,
build()'s sibling over the same helpers, the checks before the first step (`check`), and
`step.factory` (`load`).

The step's whole state (any pytree) is the train state's `params` field, so sharding
(its logical annotations, or mesh.auto_shard's rule for unannotated leaves), checkpoints,
bitwise resume, `--verify_resume`, the state hashes of `jtrain diff` / `replay` and the
skip ledger hold for it as they do for the built-in update; `opt_state`, `ema` and
`model_state` are left out of its tree (the step keeps its optimizers itself).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jtrain import invariant
from jtrain import mesh as mesh_lib
from jtrain import precision as precision_lib
from jtrain import state as state_lib
from jtrain import step as step_lib
from jtrain.engine import checks as model_checks
from jtrain.engine import evaluation as evaluator
from jtrain.engine import parts
from jtrain.errors import ConfigError, ModelError, first_line

# Config keys that configure the built-in update and have no meaning for a step of
# your own: (key, its default-or-off test, what to do instead).
_BUILT_IN_ONLY = (
    ("optim.grad_accum_steps", lambda c: c.optim.grad_accum_steps == 1,
     "accumulate inside update (jtrain.step.accumulated)"),
    ("optim.ema.decay", lambda c: not c.optim.ema.decay > 0,
     "keep a target or average in the step's state"),
    ("population.size", lambda c: c.population.size <= 1, "run one step per run"),
    ("finetune.lora.rank", lambda c: not c.finetune.lora.rank,
     "wrap the model inside the step"),
    ("log.train_metrics", lambda c: not c.log.train_metrics,
     "return them from update as metrics"),
    ("model.loss_scale", lambda c: c.model.loss_scale != "dynamic",
     "scale the loss inside the step"),
    # The step calls its model itself: jtrain's cast to a compute dtype (and fp16's loss
    # scaling) never reaches it, so a 16-bit model.dtype would be reported, not run.
    ("model.dtype", lambda c: c.model.dtype in ("auto", "float32"),
     "cast inside the step (e.g. the model's dtype=jnp.bfloat16)"),
    ("model.quant", lambda c: c.model.quant == "none",
     "quantise inside the step (qwix.quantize_model on the step's model)"),
    # Masks and factors of the built-in optax chain, which the step does not call.
    *((f"optim.{key}", lambda c, key=key: not c.optim[key],
       "freeze or scale parameters inside update") for key in ("trainable", "frozen",
                                                               "lr_mults")),
)


def load(step_cfg) -> step_lib.Step:
    """`step.factory(**step.kwargs)`: a jtrain.step.Step (a ConfigError naming the key
    when it cannot be loaded, raises, or returns something else)."""
    from jtrain.config.named import call_factory, load_named

    factory = load_named(step_cfg.factory, "step.factory", ConfigError)
    kwargs = dict(step_cfg.kwargs)
    made = call_factory("step", factory, step_cfg.factory, kwargs, kwargs)
    call = f"{step_cfg.factory}(**{kwargs})"
    if not isinstance(made, step_lib.Step):
        raise ConfigError("step.factory", f"{call} returned {type(made).__name__}, not a "
                                          "jtrain.step.Step(init=..., update=..., evaluate=...)")
    return made


def name_of(step: step_lib.Step) -> str:
    return step.name or getattr(step.update, "__qualname__", "step").split(".")[0]


def build(cfg, step: step_lib.Step, *, eval_example, train_example, loss_fn) -> parts.Build:
    """build()'s sibling for a step of your own, over the same helpers: the keys of the
    built-in update refused, the step's state (shapes first, then init), `update` inside
    the engine's guard, `evaluate` scored by jtrain's metrics and loss."""
    refuse_built_in_keys(cfg, step)
    mesh, policy = mesh_lib.make_mesh(cfg.mesh), precision_lib.make_policy(cfg.model)
    loss = parts.loss_of(cfg, loss_fn)
    example = jax.tree.map(np.asarray, train_example if train_example is not None
                           else eval_example)
    abstract, shardings, init = _state(cfg, step, example, mesh, policy)
    eval_spec, eval_step, eval_tail = _eval(cfg, step, mesh, loss, abstract, shardings,
                                            eval_example)
    return parts.Build(
        mesh=mesh, policy=policy, model_name=f"step {name_of(step)}", sample_inputs=example,
        loss_fn=loss.fn, abstract=abstract, shardings=shardings, state_abstract=abstract,
        state_shardings=shardings, init=init,
        train_step=_train_step(cfg, step, mesh, loss, shardings), eval_step=eval_step,
        eval_tail=eval_tail, eval_spec=eval_spec, user_step=step)


def refuse_built_in_keys(cfg, step) -> None:
    """Keys of the built-in update set to a value a step of your own cannot honour: a
    ConfigError naming the key and what to do instead."""
    for key, ok, instead in _BUILT_IN_ONLY:
        if not ok(cfg):
            raise ConfigError(key, f"configures the built-in update; with a step of your "
                                   f"own (step.factory: {name_of(step)}), {instead}")


def _state(cfg, step, example, mesh, policy):
    """(abstract, shardings, init): the step's state, shapes first (`init` traced on one
    training example): sharded by its logical annotations, unannotated leaves by
    mesh.auto_shard's rule; the engine's fields (step, rng, counters, lr factor) beside
    it, replicated."""
    rng = jax.random.key(cfg.seed)
    try:
        annotated = jax.eval_shape(step.init, jax.random.fold_in(rng, 0), example)
    except Exception as e:  # noqa: BLE001 - the user's init: one line
        raise ModelError(f"step {name_of(step)}", f"init(rng, example) raised "
                         f"{type(e).__name__}: {first_line(e)}") from None
    with jax.set_mesh(mesh):
        user_shardings = mesh_lib.logical_to_shardings(
            annotated, mesh, auto_shard_min_bytes=mesh_lib.auto_shard_bytes(cfg.mesh))
    abstract = jax.eval_shape(functools.partial(_fresh, policy=policy, rng=rng),
                              nn.unbox(annotated))
    repl = mesh_lib.replicated(mesh)
    shardings = jax.tree.map(lambda _: repl, abstract).replace(params=user_shardings)
    return abstract, shardings, functools.partial(_init, step, example, rng, policy,
                                                  shardings, mesh)


def _train_step(cfg, step, mesh, loss, shardings):
    """`update` inside the engine's guard (jtrain.step.make_step_train), jitted with the
    state's shardings and the state donated."""
    fn = step_lib.make_step_train(step, halt_on_nonfinite=cfg.nonfinite.policy == "halt",
                                  max_consecutive=cfg.nonfinite.max_consecutive,
                                  valid_fn=loss.valid_fn)
    repl = mesh_lib.replicated(mesh)
    if parts.invariant_of(cfg, mesh) is not None:  # whole on every device: same bits
        return invariant.Whole(fn, mesh, (shardings, repl))
    return jax.jit(fn, in_shardings=(shardings, mesh_lib.batch_sharding(mesh)),
                   out_shardings=(shardings, repl), donate_argnums=0)


def _eval(cfg, step, mesh, loss, abstract, shardings, example):
    """(spec, eval_step, eval_tail): `evaluate(state, batch)` scored by jtrain's metrics
    and loss (the run's loss_fn / loss.fn, else the default loss on its outputs and the
    batch's targets); all None without `evaluate`."""
    if step.evaluate is None:
        return None, None, None
    apply = _as_apply(step.evaluate)
    spec = evaluator.make_spec(cfg.eval, apply, abstract.params,
                               model_checks.example_batch(example), example,
                               predict_fn=loss.predict_fn, model_inputs=tuple(example))
    return (spec, *parts.eval_steps(cfg, mesh, apply, loss._replace(model_inputs=()), spec,
                                    shardings.params, forward=step.evaluate))


def check(cfg, b, data) -> None:
    """Before the first step: `update` keeps the state's structure and dtypes and returns
    scalar metrics with a "loss"; `evaluate` exists when the run evaluates. Each a
    ModelError naming the step and what to change."""
    step, who = b.user_step, f"step {name_of(b.user_step)}"
    if data.eval is not None and step.evaluate is None and _held_out(data):
        raise ConfigError("data.val_fraction", f"{cfg.data.val_fraction} of the train data is "
                          f"held out for eval (no eval data was given) but {who} has no "
                          "evaluate(state, batch) -> outputs; add one, or set "
                          "data.val_fraction=0 to train on all of it")
    if data.eval is not None and step.evaluate is None:
        raise ModelError(who, "the run evaluates (eval data is given) but the step has no "
                              "evaluate(state, batch) -> outputs; add one, or pass no eval data")
    batch = model_checks.example_batch(data.train_example, cfg.data.batch_size)
    context = step_lib.Context(step=jax.ShapeDtypeStruct((), jnp.int32),
                               lr_factor=jax.ShapeDtypeStruct((), jnp.float32))
    try:
        new, metrics = jax.eval_shape(_materialized(step.update), b.abstract.params, batch,
                                      jax.eval_shape(lambda: jax.random.key(0)), context)
    except Exception as e:  # noqa: BLE001 - the user's update: one line
        raise ModelError(who, f"update(state, batch, rng, context) raised "
                              f"{type(e).__name__}: {first_line(e)}") from None
    _check_same_state(who, b.abstract.params, new)
    if not isinstance(metrics, dict) or "loss" not in metrics:
        got = sorted(metrics) if isinstance(metrics, dict) else type(metrics).__name__
        raise ModelError(who, f"update must return (state, metrics) with a scalar "
                              f"metrics['loss'] (the number progress, early stopping and "
                              f"the non-finite guard follow); got metrics {got}")
    for k, v in metrics.items():
        if getattr(v, "shape", None) != ():
            raise ModelError(who, f"metric {k!r} has shape {getattr(v, 'shape', None)}; "
                                  "update's metrics are scalars (reduce it, e.g. .mean())")


def _held_out(data) -> bool:
    """Whether the eval set is data.val_fraction's share of the train data (the data layer
    notes the split it made) rather than eval data the user gave."""
    return any("data.val_fraction" in note for note in data.info.get("notes", ()))


def _materialized(update):
    """`update` with a state returned as a function (applied when kept) called."""
    def call(*args):
        new, metrics = update(*args)
        return (new() if callable(new) else new), metrics
    return call


def _check_same_state(who, before, after) -> None:
    flat_a = dict(_flat(before))
    flat_b = dict(_flat(after))
    if flat_a.keys() != flat_b.keys():
        extra = sorted(set(flat_b) - set(flat_a))
        missing = sorted(set(flat_a) - set(flat_b))
        raise ModelError(who, "update changed the state's structure ("
                         + ", ".join([f"new leaf {p}" for p in extra[:2]]
                                     + [f"missing leaf {p}" for p in missing[:2]])
                         + "); return the state with the leaves init made")
    for path, a in flat_a.items():
        b = flat_b[path]
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            raise ModelError(who, f"update changed {path} from {a.dtype}{list(a.shape)} to "
                                  f"{b.dtype}{list(b.shape)}; keep each leaf's shape and "
                                  "dtype (cast back, e.g. .astype(old.dtype))")


def _flat(tree):
    return [(jax.tree_util.keystr(p, simple=True, separator="/") or "state", leaf)
            for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _as_apply(evaluate):
    def apply(params, inputs, rng=None, train=False):
        del rng, train
        return evaluate(params, inputs)
    return apply


def _fresh(user_state, *, policy, rng):
    return state_lib.TrainState(
        step=jnp.asarray(0, jnp.int32), params=user_state, opt_state=None,
        rng=jax.random.key_data(jax.random.fold_in(rng, 1)),
        loss_scale=precision_lib.init_loss_scale(policy),
        skipped_steps=jnp.asarray(0, jnp.int32), consecutive_skips=jnp.asarray(0, jnp.int32),
        halted_at=jnp.asarray(0, jnp.int32), lr_factor=jnp.asarray(1.0, jnp.float32))


def _bits(x) -> np.ndarray:
    """A trace constant as numpy (a PRNG key as its key data)."""
    if jnp.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


def _init(step, example, rng, policy, shardings, mesh):
    """The fresh state in its shardings; `init` traced twice must give the same program
    and constants (a pure function of rng and example: a numpy or Python draw becomes a
    different constant in each trace), else a ModelError before the first step. Nothing
    runs twice."""
    def create():
        user = nn.unbox(step.init(jax.random.fold_in(rng, 0), example))
        return _fresh(user, policy=policy, rng=rng)

    with jax.set_mesh(mesh):
        traces = [jax.make_jaxpr(lambda: create())() for _ in range(2)]
        first = jax.jit(create, out_shardings=shardings)()
    a, b = traces
    if str(a.jaxpr) != str(b.jaxpr) or len(a.consts) != len(b.consts) or not all(
            np.array_equal(_bits(x), _bits(y)) for x, y in zip(a.consts, b.consts,
                                                                strict=True)):
        raise ModelError(f"step {name_of(step)}", "init(rng, example) gave different "
                         "states for the same rng: make it a pure function of its "
                         "arguments (draw randomness from rng, not numpy or Python)")
    return first

