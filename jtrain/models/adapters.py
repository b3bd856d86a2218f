"""One model interface for the engine: Linen, NNX, or a pure (init, apply) pair.

Every model becomes a `ModelFns`:
  init(rng, inputs) -> params          pure; may return flax logical-partitioning boxes
  apply(params, inputs, rng, train)    pure; -> outputs
`init` is only ever traced by `jax.eval_shape` and then run under `jax.jit` with
`out_shardings`, so parameters are created already sharded, never on one device first.

Accepted user models:
  * a `flax.linen.Module`;
  * a `flax.nnx.Module` instance (its existing parameters are used and resharded), a
    function `rngs -> nnx.Module`, or an NNX Module class whose constructor takes `rngs`
    (built as `cls(rngs=nnx.Rngs(<from config.seed>))`; both created shapes-first, like
    Linen);
  * a tuple `(init, apply)` with `init(rng, inputs) -> params` and
    `apply(params, inputs[, rng=..., train=...]) -> outputs`.
Models are called with `batch["inputs"]`. If the call signature has `train` (or
`deterministic`) it is passed; dropout draws from the `"dropout"` rng stream.

State beyond parameters (BatchNorm's running statistics: Linen's `batch_stats`, NNX's
`nnx.BatchStat`; any other Linen collection or NNX variable that is not a parameter or
RNG state) is the model's *state*: `state_init(rng, inputs)` creates it (`{}` for a
model without), and `apply` takes `Variables(params, state)` in place of the params:
in train mode with `mutable=True` it returns `(outputs, new_state)` (the statistics of
this batch folded in), otherwise the outputs computed with that state (evaluation uses
the running statistics). Called with plain params, a model with state sees zeros of its
shape (shape checks only; the engine always passes the state it carries).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import linen as nn

from jtrain import mesh as mesh_lib
from jtrain.state import Variables
from jtrain.errors import ConfigError


class _LazyNnx:
    """flax.nnx, imported where an NNX model is handled (a Linen run never imports it:
    ~0.2 s of start-up). Type checks go through `is_nnx`, which imports nothing."""

    def __getattr__(self, name):
        from flax import nnx as module

        return getattr(module, name)


nnx: Any = _LazyNnx()


def is_nnx(x, *, cls: bool = False) -> bool:
    """An NNX Module instance (a subclass with `cls`), without importing flax.nnx
    (`jtrain.mesh.loaded_nnx`)."""
    module = mesh_lib.loaded_nnx()
    if module is None:
        return False
    if cls:
        return isinstance(x, type) and issubclass(x, module.Module)
    return isinstance(x, module.Module)


def split_variables(params):
    """(params, state or None) of what `apply` was given."""
    if isinstance(params, Variables):
        return params.params, params.state
    return params, None


@dataclasses.dataclass(frozen=True)
class NnxGraph:
    """An NNX model split once: graph definition, annotated parameter State (the
    template of shapes, dtypes and sharding names), the carried state (variables that
    are neither parameters nor RNG state: BatchStat, counters) and the RNG state."""
    graphdef: Any
    template: Any
    carried: Any
    rest: Any

    @classmethod
    def of(cls, model: nnx.Module) -> NnxGraph:
        # flax types split's result as variadic; with three filters it is exactly four
        graphdef, params, rngs, carried = nnx.split(  # type: ignore[misc]
            model, nnx.Param, nnx.RngState, ...)
        return cls(graphdef, params, carried, rngs)


@dataclasses.dataclass(frozen=True)
class ModelFns:
    """A model as pure functions, whatever it was handed over as (Linen, NNX or a pure
    `(init, apply)` pair): what the state, the steps and the checks call.

    Attributes:
        init: `init(rng, inputs) -> params`, plain arrays.
        apply: `apply(params, inputs, ...) -> outputs`.
        kind: "linen", "nnx" or "pure".
        existing_params: an NNX instance's own parameters, used instead of `init`.
        nnx_graph: NNX: the split model that `apply` merges the parameters into.
        state_init: `(rng, inputs) -> the model's state beyond parameters` ({} if none).
        existing_state: an NNX instance's current state (BatchNorm statistics).
        abstract_variables: Linen: `(rng, inputs) -> (annotated abstract params,
            abstract state)` from one trace (None for the other kinds).

    Examples:
        ```python
        fns = jtrain.to_model_fns((init, apply))    # a pure pair
        params = fns.init(jax.random.key(0), x)
        y = fns.apply(params, x)
        ```
    """
    init: Callable[[jax.Array, Any], Any]
    apply: Callable[..., Any]
    kind: str  # "linen", "nnx", "pure"
    existing_params: Any = None  # NNX instance: its parameters, used instead of init
    nnx_graph: NnxGraph | None = None  # NNX: the split model apply() merges params into
    # (rng, inputs) -> the model's state beyond parameters ({} when it has none)
    state_init: Callable[[jax.Array, Any], Any] = lambda rng, inputs: {}
    existing_state: Any = None  # NNX instance: its current state (BatchNorm statistics)
    # Linen: (rng, inputs) -> (annotated abstract params, abstract state), one trace for both
    abstract_variables: Callable[[jax.Array, Any], tuple[Any, Any]] | None = None

    def abstract_and_shardings(self, rng, inputs, mesh, *,
                               auto_shard_min_bytes: int | None = None):
        """(abstract plain params, their NamedShardings), with no allocation; leaves
        without annotations follow mesh.auto_shard (`auto_shard_min_bytes`, None = off).

        Call under `jax.set_mesh(mesh)`."""
        annotated = self.annotated(rng, inputs)
        shardings = mesh_lib.logical_to_shardings(
            annotated, mesh, auto_shard_min_bytes=auto_shard_min_bytes)
        if self.kind == "nnx":
            abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                    nnx.to_pure_dict(annotated))
            return abstract, nnx.to_pure_dict(shardings)
        return nn.unbox(annotated), shardings

    def annotated(self, rng, inputs):
        """The abstract params with their partitioning annotations (Linen boxes, NNX
        variables): what mesh.logical_to_shardings and mesh.sharding_conflicts read."""
        if self.kind == "nnx":
            return self.nnx_graph.template
        if self.abstract_variables is not None:
            return self.abstract_variables(rng, inputs)[0]
        return jax.eval_shape(self.init, rng, inputs)

    def abstract_state(self, rng, inputs):
        """The shapes of `state_init(rng, inputs)` (nothing allocated)."""
        if self.abstract_variables is not None:
            return self.abstract_variables(rng, inputs)[1]
        return jax.eval_shape(self.state_init, rng, inputs)


def _mode_kwargs(fn: Callable, train: bool) -> dict:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    if "train" in params:
        return {"train": train}
    if "deterministic" in params:
        return {"deterministic": not train}
    return {}


# Linen collections that are not state: what `sow` records for inspection.
_NOT_STATE = ("params", "intermediates")


def from_linen(module: nn.Module) -> ModelFns:
    def variables_of(rng, inputs):
        return module.init({"params": rng, "dropout": rng}, inputs,
                           **_mode_kwargs(module.__call__, False))

    def init(rng, inputs):
        return variables_of(rng, inputs)["params"]

    def state_init(rng, inputs):  # every other collection: batch_stats, counters, ...
        return {k: nn.unbox(v) for k, v in variables_of(rng, inputs).items()
                if k not in _NOT_STATE}

    def abstract_variables(rng, inputs):
        """The abstract params (boxed) and state of one trace of init (JAX keeps the trace
        of `variables_of` per argument shapes: the parameter shardings, the abstract state
        and a call with plain params all reuse it)."""
        variables = jax.eval_shape(variables_of, rng, inputs)
        return variables["params"], {k: nn.unbox(v) for k, v in variables.items()
                                     if k not in _NOT_STATE}

    shapes: dict = {}  # the state's shapes per input shape: traced once, not per call

    def default_state(inputs):
        """Zeros of the state's shapes (a call with plain params: shape checks only)."""
        key = (str(jax.tree.structure(inputs)),
               tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(inputs)))
        if key not in shapes:
            shapes[key] = abstract_variables(jax.random.key(0), inputs)[1]
        return _zeros(shapes[key])

    def apply(params, inputs, rng=None, train=False, mutable=False):
        params, state = split_variables(params)
        if state is None:
            state = default_state(inputs)
        rngs = {"dropout": rng} if (train and rng is not None) else {}
        kwargs = _mode_kwargs(module.__call__, train)
        if mutable:
            out, changed = module.apply({"params": params, **state}, inputs, rngs=rngs,
                                        mutable=list(state), **kwargs)
            return out, {**state, **changed}
        return module.apply({"params": params, **state}, inputs, rngs=rngs, **kwargs)

    return ModelFns(init=init, apply=apply, kind="linen", state_init=state_init,
                    abstract_variables=abstract_variables)


def _zeros(abstract):
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract)


def from_nnx(model_or_factory, mesh=None) -> ModelFns:
    """NNX parameters travel as plain nested dicts of arrays (`nnx.to_pure_dict`),
    so optimizer masks, checkpoints and hashes see the same tree for every model kind.
    The model is split once, here: an instance as it is, a factory shapes-first
    (`nnx.eval_shape`) under `jax.set_mesh(mesh)`, which NNX needs for parameters
    annotated with `nnx.with_partitioning` (without a mesh: the caller's mesh context)."""
    if is_nnx(model_or_factory):
        graph, factory = NnxGraph.of(model_or_factory), None
        existing = nnx.to_pure_dict(graph.template)
        existing_state = nnx.to_pure_dict(graph.carried)
    else:
        factory, existing, existing_state = model_or_factory, None, None
        graph = _abstract_graph(factory, mesh)

    def built(rng):
        with mesh_lib.model_context():  # logical names -> the caller's mesh
            return factory(nnx.Rngs(rng))

    def init(rng, inputs):
        del inputs
        return nnx.to_pure_dict(nnx.split(built(rng), nnx.Param, ...)[1])

    def state_init(rng, inputs):
        del inputs
        if factory is None or not jax.tree.leaves(graph.carried):
            return existing_state if factory is None else {}
        return nnx.to_pure_dict(NnxGraph.of(built(rng)).carried)

    def apply(params, inputs, rng=None, train=False, mutable=False):
        params, state = split_variables(params)
        carried = _with_values(graph.carried, state)
        rest = graph.rest
        if train and rng is not None:
            rest = _fresh_rng_state(rest, rng)
        model = nnx.merge(graph.graphdef, params, carried, rest)
        model.train() if train else model.eval()
        out = model(inputs, **_mode_kwargs(type(model).__call__, train))
        if mutable:
            return out, nnx.to_pure_dict(NnxGraph.of(model).carried)
        return out

    return ModelFns(init=init, apply=apply, kind="nnx", existing_params=existing,
                    nnx_graph=graph, state_init=state_init, existing_state=existing_state)


def _with_values(template, values):
    """A copy of the NNX State `template` holding `values` (a pure dict of the same
    variables); zeros of its shapes when `values` is None."""
    state = jax.tree.map(lambda x: x, template)
    if values is None:
        values = _zeros(nnx.to_pure_dict(template))
    if values:
        nnx.replace_by_pure_dict(state, values)
    return state


def _abstract_graph(factory, mesh) -> NnxGraph:
    """The factory's model built shapes-first under the mesh and jtrain's logical-axis
    rules. An annotation naming neither a rule nor a mesh axis is a ConfigError naming the
    parameter (found on a second build without eager sharding: the first fails inside
    flax)."""
    try:
        with mesh_lib.model_context(mesh):
            return NnxGraph.of(nnx.eval_shape(lambda: factory(nnx.Rngs(0))))
    except Exception as e:
        if mesh is None:
            raise
        try:
            with nnx.use_eager_sharding(False):  # names recorded, nothing sharded
                template = NnxGraph.of(nnx.eval_shape(lambda: factory(nnx.Rngs(0)))).template
            unknown = mesh_lib.unknown_axes(template, mesh)
        except Exception:  # noqa: BLE001 - the first error is the one to report
            unknown = []
        if unknown:
            raise ConfigError("model", unknown[0]) from None
        raise e


def with_compute_dtype(model, dtype, keep_fp32=("norm",)):
    """`model` computing in `dtype` where it exposes its compute dtype: a Linen module's
    `dtype` field (a clone), an NNX module's (or the module an NNX factory or class
    builds) `dtype` attribute on every submodule that has one (None or floating; a copy
    of an instance), except submodules whose path or class matches a `keep_fp32` regex
    (norms keep theirs). Anything else (an (init, apply) pair) unchanged."""
    if isinstance(model, nn.Module):
        fields = {f.name for f in dataclasses.fields(model)}
        if "dtype" in fields and _float_or_none(model.dtype):
            return model.clone(dtype=dtype)
        return model
    if is_nnx(model):
        return _set_nnx_dtype(nnx.merge(*nnx.split(model)), dtype, keep_fp32)  # a copy
    if is_nnx(model, cls=True):
        model = nnx_class_factory(model)
    if callable(model) and not isinstance(model, type) and not isinstance(model, tuple):

        @functools.wraps(model)
        def factory(rngs):
            return _set_nnx_dtype(model(rngs), dtype, keep_fp32)

        return factory
    return model


def _float_or_none(value) -> bool:
    if value is None:
        return True
    try:
        return jnp.issubdtype(jnp.dtype(value), jnp.floating)
    except TypeError:
        return False


def _set_nnx_dtype(model, dtype, keep_fp32):
    keep = [re.compile(p, re.IGNORECASE) for p in keep_fp32]
    if is_nnx(model):
        for path, module in nnx.iter_modules(model):
            where = "/".join(map(str, (*path, type(module).__name__)))
            if (hasattr(module, "dtype") and _float_or_none(module.dtype)
                    and not any(r.search(where) for r in keep)):
                module.dtype = dtype
    return model


def _fresh_rng_state(rest, key):
    """`rest` with every RNG key replaced by one derived from `key`. Built inside the
    trace (not mutated with nnx.reseed: `rest` belongs to an outer trace)."""
    leaves, treedef = jax.tree.flatten(rest)
    out = [jax.random.fold_in(key, i)
           if jnp.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key) else x
           for i, x in enumerate(leaves)]
    return jax.tree.unflatten(treedef, out)


def from_pure(init_apply) -> ModelFns:
    user_init, user_apply = init_apply
    accepts = _mode_kwargs(user_apply, True)
    try:
        takes_rng = "rng" in inspect.signature(user_apply).parameters
    except (TypeError, ValueError):
        takes_rng = False

    def apply(params, inputs, rng=None, train=False):
        kwargs = _mode_kwargs(user_apply, train) if accepts else {}
        if takes_rng:
            kwargs["rng"] = rng
        return user_apply(params, inputs, **kwargs)

    return ModelFns(init=user_init, apply=apply, kind="pure")


def nnx_class_factory(cls: type[Any]) -> Callable[[nnx.Rngs], nnx.Module]:
    """An NNX Module class as the factory `rngs -> cls(rngs=rngs)` (a TypeError naming
    the class when its constructor needs more than `rngs`)."""
    try:  # the constructor's own signature (the class's is its metaclass's *args, **kwargs)
        params = dict(list(inspect.signature(cls.__init__).parameters.items())[1:])
    except (TypeError, ValueError):
        params = {}
    kinds = {p.kind for p in params.values()}
    takes_rngs = "rngs" in params or inspect.Parameter.VAR_KEYWORD in kinds
    needed = [n for n, p in params.items() if n != "rngs" and p.default is p.empty
              and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if params and (not takes_rngs or needed):
        what = f"also needs {', '.join(needed)}" if takes_rngs else "takes no rngs"
        raise TypeError(
            f"model: the NNX class {cls.__name__} is built as {cls.__name__}(rngs=...), but "
            f"its constructor {what}; pass an instance, or a function rngs -> "
            f"{cls.__name__}(..., rngs=rngs)")

    def factory(rngs):
        return cls(rngs=rngs)

    factory.__name__ = factory.__qualname__ = cls.__name__
    return factory


class ModelTypeError(ConfigError, TypeError):
    """`model` is not something jtrain can train (a ConfigError, and a TypeError as it
    always was)."""


def model_kind_error(model) -> str | None:
    """None for a model `to_model_fns` takes, else what it is and what it takes."""
    if isinstance(model, nn.Module) or is_nnx(model):
        return None
    if isinstance(model, (tuple, list)) and len(model) == 2 and all(map(callable, model)):
        return None
    if is_nnx(model, cls=True):
        return None
    if isinstance(model, type) and issubclass(model, nn.Module):
        return (f"{model.__name__} is a flax.linen.Module class; pass an instance, e.g. "
                f"model={model.__name__}(...)")
    if callable(model) and not isinstance(model, type):
        return None
    return ("expected a flax.linen.Module, a flax.nnx.Module (an instance, a class taking "
            "rngs, or a function rngs -> nnx.Module), or an (init, apply) pair; got "
            f"{type(model).__name__}")


def to_model_fns(model, mesh=None) -> ModelFns:
    """Dispatch on what the user handed over; a clear ModelTypeError (one line, key
    `model`) for anything else. `mesh`: where an NNX factory's partitioned parameters
    will live (see from_nnx).

    Examples:
        ```python
        fns = jtrain.to_model_fns(Net)              # an NNX class, instance or factory,
        params = fns.init(jax.random.key(0), x)     # a Linen module, or (init, apply)
        logits = fns.apply(params, x)
        print(fns.kind)                             # "nnx"
        ```
    """
    why = model_kind_error(model)
    if why:
        raise ModelTypeError("model", why)
    if isinstance(model, nn.Module):
        return from_linen(model)
    if is_nnx(model):
        return from_nnx(model, mesh)
    if isinstance(model, (tuple, list)):
        return from_pure(model)
    if isinstance(model, type):
        return from_nnx(nnx_class_factory(model), mesh)
    return from_nnx(model, mesh)
