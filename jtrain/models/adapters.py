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
Only parameters are trained and carried from step to step: a model with other state
(BatchNorm's running statistics: nnx.BatchStat, Linen's batch_stats; any variable a
forward pass changes) is refused with a ModelError before the first step.
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
from flax import nnx

from jtrain import mesh as mesh_lib
from jtrain.errors import ConfigError, ModelError


@dataclasses.dataclass(frozen=True)
class NnxGraph:
    """An NNX model split once: graph definition, annotated parameter State (the
    template of shapes, dtypes and sharding names) and the rest (RNG state, ...)."""
    graphdef: Any
    template: Any
    rest: Any

    @classmethod
    def of(cls, model: nnx.Module) -> NnxGraph:
        # flax types split's result as variadic; with two filters it is exactly three
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
        return cls(graphdef, params, rest)


@dataclasses.dataclass(frozen=True)
class ModelFns:
    init: Callable[[jax.Array, Any], Any]
    apply: Callable[..., Any]
    kind: str  # "linen", "nnx", "pure"
    existing_params: Any = None  # NNX instance: its parameters, used instead of init
    nnx_graph: NnxGraph | None = None  # NNX: the split model apply() merges params into

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
        return jax.eval_shape(self.init, rng, inputs)


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


def from_linen(module: nn.Module) -> ModelFns:
    def init(rng, inputs):
        variables = module.init({"params": rng, "dropout": rng}, inputs,
                                **_mode_kwargs(module.__call__, False))
        extra = sorted(set(variables) - {"params"})
        if extra:  # apply() passes only params: any other collection would be lost
            raise state_error(type(module).__name__, "Linen variable collection"
                              + ("s " if len(extra) > 1 else " ")
                              + ", ".join(map(repr, extra))
                              + (" (BatchNorm)" if "batch_stats" in extra else ""),
                              stats="batch_stats" in extra)
        return variables["params"]

    def apply(params, inputs, rng=None, train=False):
        rngs = {"dropout": rng} if (train and rng is not None) else {}
        return module.apply({"params": params}, inputs, rngs=rngs,
                            **_mode_kwargs(module.__call__, train))

    return ModelFns(init=init, apply=apply, kind="linen")


def from_nnx(model_or_factory, mesh=None) -> ModelFns:
    """NNX parameters travel as plain nested dicts of arrays (`nnx.to_pure_dict`),
    so optimizer masks, checkpoints and hashes see the same tree for every model kind.
    The model is split once, here: an instance as it is, a factory shapes-first
    (`nnx.eval_shape`) under `jax.set_mesh(mesh)`, which NNX needs for parameters
    annotated with `nnx.with_partitioning` (without a mesh: the caller's mesh context)."""
    if isinstance(model_or_factory, nnx.Module):
        graph, factory = NnxGraph.of(model_or_factory), None
        existing = nnx.to_pure_dict(graph.template)
    else:
        factory, existing = model_or_factory, None
        graph = _abstract_graph(factory, mesh)
    _refuse_batch_stats(graph)

    def init(rng, inputs):
        del inputs
        with mesh_lib.model_context():  # logical names -> the caller's mesh
            model = factory(nnx.Rngs(rng))
        return nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[1])

    def apply(params, inputs, rng=None, train=False):
        rest = graph.rest
        if train and rng is not None:
            rest = _fresh_rng_state(rest, rng)
        model = nnx.merge(graph.graphdef, params, rest)
        model.train() if train else model.eval()
        return model(inputs, **_mode_kwargs(type(model).__call__, train))

    return ModelFns(init=init, apply=apply, kind="nnx", existing_params=existing,
                    nnx_graph=graph)


# apply() merges the state other than parameters as it was when the model was split, and
# the train step carries only parameters: running statistics updated in a forward pass
# would be dropped after every step, and evaluation would use their initial values.
_STATS_HINT = ("running statistics are not carried by the train step yet; use "
               "LayerNorm/RMSNorm or GroupNorm, or write the model without BatchNorm")
_STATE_HINT = ("state other than parameters is not carried by the train step yet (each "
               "step would start from its initial value); keep it outside the model or "
               "compute it from the inputs")


def state_error(model: str, what: str, *, stats: bool) -> ModelError:
    """The one line for a model holding state the train step would drop: `what` names
    the variables or collections; `stats`: BatchNorm's running statistics among them."""
    return ModelError(model, f"{what}: {_STATS_HINT if stats else _STATE_HINT}")


def _names(paths) -> str:
    shown = [".".join(map(str, p)) for p in paths[:4]]
    return ", ".join(shown) + (f", ... ({len(paths)})" if len(paths) > 4 else "")


def _root_name(graph: NnxGraph) -> str:
    built = getattr(graph.graphdef.nodes[0], "type", None)
    return built.__name__ if isinstance(built, type) else "the model"


def _refuse_batch_stats(graph: NnxGraph) -> None:
    """A ModelError for nnx.BatchStat variables (BatchNorm's running statistics), found
    by type before anything is traced."""
    stats = [p for p, v in nnx.to_flat_state(graph.rest) if isinstance(v, nnx.BatchStat)]
    if stats:
        raise state_error(_root_name(graph), f"nnx.BatchStat variables {_names(stats)} "
                          "(BatchNorm)", stats=True)


def check_state_carried(fns: ModelFns, params, inputs) -> None:
    """NNX: a ModelError when a forward pass in train mode changes a variable other than
    an nnx.Param (RNG state aside: the step draws its own keys), e.g. a counter or
    statistics kept by hand. Traced on shapes (`params`, `inputs`: ShapeDtypeStructs);
    a model that cannot be called here is left to the pre-flight checks
    (jtrain.engine.checks), which say why."""
    graph = fns.nnx_graph
    if graph is None or not any(not isinstance(v, nnx.RngState)
                                for _, v in nnx.to_flat_state(graph.rest)):
        return
    changed = []

    def forward(params, rest, inputs):
        before = {p: v.get_raw_value() for p, v in nnx.to_flat_state(rest)}
        model = nnx.merge(graph.graphdef, params, rest)
        model.train()
        model(inputs, **_mode_kwargs(type(model).__call__, True))
        for path, v in nnx.to_flat_state(nnx.split(model, nnx.Param, ...)[2]):
            if (path in before and not isinstance(v, nnx.RngState)
                    and v.get_raw_value() is not before[path]):
                changed.append((path, type(v).__name__))

    try:
        jax.eval_shape(forward, params, graph.rest, inputs)
    except Exception:  # noqa: BLE001 - model_checks reports a model it cannot call
        return
    if changed:
        kinds = ", ".join(sorted({k for _, k in changed}))
        plural = "s" if len(changed) > 1 else ""
        raise state_error(_root_name(graph), f"variable{plural} {_names([p for p, _ in changed])}"
                          f" ({kinds}) changed by a forward pass in train mode", stats=False)


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
    if isinstance(model, nnx.Module):
        return _set_nnx_dtype(nnx.merge(*nnx.split(model)), dtype, keep_fp32)  # a copy
    if isinstance(model, type) and issubclass(model, nnx.Module):
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
    if isinstance(model, nnx.Module):
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
    if isinstance(model, (nn.Module, nnx.Module)):
        return None
    if isinstance(model, (tuple, list)) and len(model) == 2 and all(map(callable, model)):
        return None
    if isinstance(model, type) and issubclass(model, nnx.Module):
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
    will live (see from_nnx)."""
    why = model_kind_error(model)
    if why:
        raise ModelTypeError("model", why)
    if isinstance(model, nn.Module):
        return from_linen(model)
    if isinstance(model, nnx.Module):
        return from_nnx(model, mesh)
    if isinstance(model, (tuple, list)):
        return from_pure(model)
    if isinstance(model, type):
        return from_nnx(nnx_class_factory(model), mesh)
    return from_nnx(model, mesh)
