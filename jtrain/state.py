"""TrainState: everything the step reads and writes, as a plain pytree."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from jtrain import mesh as mesh_lib
from jtrain import precision

__all__ = ["TrainState", "eval_params", "init_state", "make_abstract_state", "state_sha256"]


@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a step changes, as one pytree: what a checkpoint saves, what
    `state_sha256` hashes (params, optimizer state, EMA and model state), what
    `jtrain.train` returns as `result.state`.

    Attributes:
        step: int32 [], batches consumed (skipped updates included).
        params: the model's parameters (plain arrays); a step of your own: its whole state.
        opt_state: the optax state.
        rng: uint32 [2], raw key data; the step's key is `fold_in(rng, step)`.
        loss_scale: `{"scale": f32 [], "good_steps": i32 []}`; scale 1 unless fp16.
        skipped_steps: int32 [], updates skipped (non-finite, invalid batch).
        consecutive_skips: int32 [], non-finite skips in a row.
        halted_at: int32 [], the step `nonfinite.*` halted at; 0 while running.
        lr_factor: float32 [], ReduceLROnPlateau's factor on the schedule.
        ema: the parameters' moving average (`optim.ema`), None when off.
        model_state: the model's state beyond parameters (BatchNorm statistics), or None.

    Examples:
        ```python
        result = jtrain.train(config, "runs/a", model=Net, train_data=data)
        state = result.state
        print(int(state.step), int(state.skipped_steps), float(state.lr_factor))
        params = jtrain.state.eval_params(state)       # the EMA's when eval.weights says so
        state = state.replace(lr_factor=jnp.float32(0.5))
        ```
    """
    step: jax.Array  # int32 [], batches consumed (skipped updates included: skipped_steps)
    params: Any  # the model's parameters (plain arrays, no metadata boxes)
    opt_state: Any  # optax state
    rng: jax.Array  # uint32 [2], raw key data; per-step keys are fold_in(rng, step)
    loss_scale: dict  # {"scale": f32 [], "good_steps": i32 []}; scale 1 unless fp16
    skipped_steps: jax.Array  # int32 [], updates skipped (non-finite, invalid batch)
    # Run control in the state, so a checkpoint holds it and the jitted step reads it
    # without a recompile when the host changes it (jtrain.control):
    consecutive_skips: jax.Array  # int32 [], non-finite skips in a row
    halted_at: jax.Array  # int32 [], the step nonfinite.* halted at; 0 = running
    lr_factor: jax.Array  # float32 [], ReduceLROnPlateau's factor on the schedule
    # optim.ema: the params' moving average (below), sharded like them; None = off,
    # so runs without it keep their state tree, checkpoints and state_sha256.
    ema: Any = None
    # The model's state beyond parameters (BatchNorm's running statistics: Linen's
    # collections, NNX's BatchStat variables; models.adapters), updated by the train
    # step, replicated; None for a model without, which keeps its tree as it was.
    model_state: Any = None

    def replace(self, **changes) -> "TrainState":
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class Variables:
    """A model's parameters with the state it carries (BatchNorm's running statistics):
    what a model's `apply` takes in place of the params when it keeps state
    (jtrain.models.adapters)."""
    params: Any
    state: Any


jax.tree_util.register_dataclass(Variables, data_fields=["params", "state"], meta_fields=[])


_FIELDS = tuple(f.name for f in dataclasses.fields(TrainState))
_OPTIONAL = ("ema", "model_state")  # left out of the tree while None


def _flatten(state: TrainState):
    """A pytree of its fields by name (GetAttrKey), `ema` and `model_state` left out
    while they are None: a run without them saves the checkpoint tree it always did, and
    restores older ones."""
    names = tuple(n for n in _FIELDS if n not in _OPTIONAL or getattr(state, n) is not None)
    return [(jax.tree_util.GetAttrKey(n), getattr(state, n)) for n in names], names


jax.tree_util.register_pytree_with_keys(
    TrainState, _flatten,
    lambda names, children: TrainState(**dict(zip(names, children, strict=True))))


def make_abstract_state(model_fns, tx, policy, sample_inputs, mesh, seed: int, *,
                        ema: bool = False, auto_shard_min_bytes="schema"):
    """(abstract TrainState, its shardings): shapes first, nothing allocated.

    Parameter shardings come from the model's logical-axis annotations, and for leaves
    without any from mesh.auto_shard's rule (`auto_shard_min_bytes`: its threshold;
    "schema" = the schema's default; None = off; `jtrain.mesh.auto_dims`); optimizer
    state that mirrors a parameter gets that parameter's sharding (so FSDP shards
    Adam's moments too), and so does the weight EMA (`ema`: keep one); everything else
    is replicated.

    Examples:
        A loop of your own from the public pieces (what `jtrain.build` assembles):

        ```python
        import jax
        import numpy as np
        import jtrain
        from jtrain import losses

        cfg = jtrain.resolve({"total_steps": 10, "optim": {"lr": 1e-2}})
        mesh = jtrain.make_mesh(cfg.mesh)
        model_fns = jtrain.to_model_fns(Net, mesh)          # Net: an nnx.Module class
        policy = jtrain.make_policy(cfg.model)
        tx, schedule = jtrain.make_optimizer(cfg.optim, cfg.total_steps)
        inputs = jax.ShapeDtypeStruct((8, 4), np.float32)   # one global batch of inputs
        abstract, shardings = jtrain.make_abstract_state(model_fns, tx, policy, inputs,
                                                         mesh, seed=0)
        state = jtrain.init_state(model_fns, tx, policy, inputs, mesh, 0, shardings)
        train_step = jax.jit(jtrain.make_train_step(model_fns.apply, losses.default_loss,
                                                    tx, schedule))
        batch = jtrain.host_to_device({"inputs": x, "targets": y}, mesh)  # numpy [8, ...]
        state, metrics = train_step(state, batch)
        print(int(state.step), float(metrics["train/loss"]))
        ```
    """
    rng = jax.eval_shape(jax.random.key, seed)  # shapes only: no key computed here
    if auto_shard_min_bytes == "schema":
        auto_shard_min_bytes = mesh_lib.auto_shard_bytes()
    with jax.set_mesh(mesh):
        abstract_params, param_shardings = model_fns.abstract_and_shardings(
            rng, sample_inputs, mesh, auto_shard_min_bytes=auto_shard_min_bytes)
        model_state = _no_empty(model_fns.abstract_state(rng, sample_inputs))
    abstract = jax.eval_shape(lambda p, m, r: _fresh_state(p, tx, policy, r, ema, m),
                              abstract_params, model_state, rng)
    repl = NamedSharding(mesh, P())
    # MaskedNode: no state for that parameter (frozen by optim.trainable / frozen).
    try:
        opt_shardings = optax.tree_map_params(
            tx, lambda leaf, p, s: leaf if isinstance(leaf, optax.MaskedNode)
            else s if leaf.shape == p.shape else repl,
            abstract.opt_state, abstract.params, param_shardings,
            transform_non_params=lambda _: repl,
            is_leaf=lambda x: isinstance(x, (jax.ShapeDtypeStruct, optax.MaskedNode)))
    except (TypeError, AttributeError):  # an init that reads dtypes (schedule_free)
        opt_shardings = _shardings_by_path(abstract, param_shardings, repl)
    shardings = jax.tree.map(lambda _: repl, abstract).replace(
        params=param_shardings, opt_state=opt_shardings,
        ema=param_shardings if ema else None,
        model_state=None if model_state is None else jax.tree.map(lambda _: repl,
                                                                   model_state))
    return abstract, shardings


def _no_empty(model_state):
    """None for a model without state ({}), else the state."""
    return model_state if jax.tree.leaves(model_state) else None


def _shardings_by_path(abstract, param_shardings, repl):
    """Optimizer-state leaves whose path ends with a parameter's path and whose shape is
    that parameter's take its sharding; the rest are replicated."""
    by_path = {jax.tree_util.keystr(p): (leaf.shape, s) for (p, leaf), s in zip(
        jax.tree_util.tree_flatten_with_path(abstract.params)[0],
        jax.tree.leaves(param_shardings), strict=True)}

    def pick(path, leaf):
        name = jax.tree_util.keystr(path)
        return next((s for key, (shape, s) in by_path.items()
                     if name.endswith(key) and leaf.shape == shape), repl)

    return jax.tree_util.tree_map_with_path(pick, abstract.opt_state)


def _fresh_state(params, tx, policy, rng, ema: bool = False, model_state=None):
    return TrainState(
        step=jnp.asarray(0, jnp.int32), params=params, opt_state=tx.init(params),
        rng=jax.random.key_data(jax.random.fold_in(rng, 1)),
        loss_scale=precision.init_loss_scale(policy),
        skipped_steps=jnp.asarray(0, jnp.int32), consecutive_skips=jnp.asarray(0, jnp.int32),
        halted_at=jnp.asarray(0, jnp.int32), lr_factor=jnp.asarray(1.0, jnp.float32),
        ema=ema_init(params) if ema else None, model_state=model_state)


def init_state(model_fns, tx, policy, sample_inputs, mesh, seed: int, shardings
               ) -> TrainState:
    """A fresh TrainState, created directly in its shardings by one jitted function
    (with the weight EMA when `shardings` has one: make_abstract_state(..., ema=True)).

    Examples:
        ```python
        abstract, shardings = jtrain.make_abstract_state(model_fns, tx, policy, inputs,
                                                         mesh, seed=0)
        state = jtrain.init_state(model_fns, tx, policy, inputs, mesh, 0, shardings)
        print(jtrain.state_sha256(state))   # the same for the same seed, on any run
        ```
    """
    ema, stateful = shardings.ema is not None, shardings.model_state is not None
    # The key and the example inputs are made inside the one jitted function: each made
    # outside would be a program of its own, compiled (or loaded) before it.
    if model_fns.existing_params is not None:  # an NNX instance the user already built
        fn = jax.jit(lambda p, m: _fresh_state(p, tx, policy, jax.random.key(seed), ema, m),
                     out_shardings=shardings)
        return fn(model_fns.existing_params,
                  model_fns.existing_state if stateful else None)

    def create():
        rng = jax.random.key(seed)
        inputs = jax.tree.map(lambda s: jnp.zeros((1,) + tuple(s.shape[1:]), s.dtype),
                              sample_inputs)
        key = jax.random.fold_in(rng, 0)
        params = nn.unbox(model_fns.init(key, inputs))
        model_state = model_fns.state_init(key, inputs) if stateful else None
        return _fresh_state(params, tx, policy, rng, ema, model_state)

    with jax.set_mesh(mesh):
        return jax.jit(create, out_shardings=shardings)()


EVAL_WEIGHTS = ("params", "ema")


def eval_params(state: TrainState, which: str = "params"):
    """What an evaluation calls the model with: the parameters of `which` = "params"
    (the trained ones; for a schedule-free optimizer the average it defines for
    evaluation) or "ema" (the weight EMA, in the params' dtypes; a ValueError when the
    state has none: optim.ema.decay = 0), with the model's state when it keeps one
    (`models.adapters.Variables`: BatchNorm's running statistics).

    Examples:
        ```python
        result = jtrain.train(config, "runs/a", model=Net, train_data=data)
        params = jtrain.state.eval_params(result.state)          # or which="ema"
        logits = model_fns.apply(params, x)
        ```
    """
    params = _eval_params(state, which)
    if state.model_state is None:
        return params
    return Variables(params, state.model_state)


def eval_part(tree: TrainState):
    """The part of a state-shaped tree (shardings, abstract values) that `eval_params`
    returns: the params, with the model's state when it keeps one."""
    if tree.model_state is None:
        return tree.params
    return Variables(tree.params, tree.model_state)


def _eval_params(state: TrainState, which: str):
    if which == "params":  # a schedule-free optimizer's own evaluation point
        from jtrain import optim as optim_lib

        averaged = optim_lib.schedule_free_eval_params(state.opt_state, state.params)
        return state.params if averaged is None else averaged
    if which == "ema":
        if state.ema is None:
            raise ValueError("eval.weights='ema': this run keeps no weight EMA "
                             "(optim.ema.decay = 0)")
        return ema_as_params(state.ema, state.params)
    raise ValueError(f"eval.weights: unknown {which!r}; choose one of: "
                     f"{', '.join(EVAL_WEIGHTS)}")


def state_sha256(state: TrainState) -> str:
    """SHA-256 over params, optimizer state, the weight EMA and the model's state (when
    kept): leaf paths,
    dtypes, shapes and bytes in path order. The same on every process, and across runs
    for identical state.

    Examples:
        ```python
        a = jtrain.train(config, "runs/a", model=Net, train_data=data)
        b = jtrain.train(config, "runs/b", model=Net, train_data=data)
        assert jtrain.state_sha256(a.state) == jtrain.state_sha256(b.state)
        assert a.summary["state_sha256"] == jtrain.state_sha256(a.state)
        ```
    """
    tree = {"params": state.params, "opt_state": state.opt_state}
    if state.ema is not None:
        tree["ema"] = state.ema
    if state.model_state is not None:
        tree["model_state"] = state.model_state
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    digest = hashlib.sha256()
    for path, leaf in sorted(leaves, key=lambda kv: jax.tree_util.keystr(kv[0])):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            leaf = multihost_utils.process_allgather(leaf, tiled=True)
        arr = np.ascontiguousarray(np.asarray(leaf))
        digest.update(jax.tree_util.keystr(path).encode())
        digest.update(f"{arr.dtype.name}{arr.shape}".encode())
        digest.update(arr.tobytes())
    return digest.hexdigest()


# -- the weight EMA (optim.ema): an exponential moving average of the parameters ----
# The average lives in `TrainState.ema`, beside the params and sharded like them; it is
# None when `optim.ema.decay` is 0, so a run without it has the state, checkpoints and
# `state_sha256` it always had. The train step moves it right after each applied update
# (`jtrain.step`), inside the guard: a skipped update leaves it untouched.
#
#     ema <- ema + (1 - d) * (params - ema)        # = d * ema + (1 - d) * params
#
# written as a step towards the params so a leaf that does not move (`optim.frozen`)
# keeps an average exactly equal to itself. `d` is `optim.ema.decay`, or with
# `optim.ema.warmup = "standard"` `min(decay, (1 + t) / (10 + t))`, t the number of
# updates applied before this one (TensorFlow's `ExponentialMovingAverage(num_updates)`
# and Keras 3's `use_ema` form): the early average follows the params closely instead of
# remembering the initialisation. The average starts as a copy of the initial params.
#
# Floating leaves are averaged in float32 whatever the params' dtype (a bfloat16 average at
# decay 0.999 would stop moving: its steps round to zero); `ema_as_params` casts it back to
# the params' dtypes for evaluation and export.

EMA_WARMUPS = ("none", "standard")


def ema_rate_fn(decay: float, warmup: str = "none") -> Callable | None:
    """`rate(t) -> d`: the decay of the update after t applied updates (t: int32 []);
    None when decay is 0 (no EMA)."""
    if not decay:
        return None
    if warmup == "none":
        return lambda t: jnp.asarray(decay, jnp.float32)
    if warmup == "standard":
        def rate(t):
            t = jnp.asarray(t, jnp.float32)
            return jnp.minimum(jnp.float32(decay), (1.0 + t) / (10.0 + t))
        return rate
    raise ValueError(f"optim.ema.warmup: unknown {warmup!r}; choose one of: "
                     f"{', '.join(EMA_WARMUPS)}")


def _ema_dtype(dtype):
    return jnp.float32 if jnp.issubdtype(dtype, jnp.floating) else dtype


def ema_init(params):
    """The average at step 0: a copy of the params (floating leaves in float32)."""
    return jax.tree.map(lambda p: jnp.array(p, dtype=_ema_dtype(p.dtype), copy=True),
                        params)


def ema_as_params(ema, params):
    """The average in the params' dtypes (what an eval step or an export takes)."""
    return jax.tree.map(lambda e, p: e if e.dtype == p.dtype else e.astype(p.dtype),
                        ema, params)


def ema_bytes_per_device(abstract_ema, shardings) -> int:
    """The average's memory on one device: its shards' bytes (the header says it)."""
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(abstract_ema), jax.tree.leaves(shardings),
                              strict=True):
        shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        total += int(np.prod(shape)) * np.dtype(leaf.dtype).itemsize
    return total
