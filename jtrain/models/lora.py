"""LoRA fine-tuning through qwix: the only reader of `config.finetune`.

With `finetune.lora.rank` r > 0 the model (a user's Linen or NNX model, or a built-in
family) goes through qwix's `LoraProvider`: each matmul weight `W` whose parameter path
matches `finetune.lora.targets` (re.search on the path every parameter pattern sees,
jtrain.optim.leaf_path: `layer_0/attn/query`, so `attn` or `encoder` name a module's
weights and `query$` one kind of weight) gets two adapters beside it, `<name>_lora_a`
[in..., r] (he-uniform) and `<name>_lora_b` [r, out...] (zeros), and the matmul
computes `x W + alpha/r * (x A) B` (qwix's names, shapes and scale). B starts at zero,
so step 0 is the base model exactly.

Only the adapters train: `to_model_fns` hands back `ADAPTERS` as the trainable patterns
the run adds to `optim.trainable` (build.py passes them to the optimizer explicitly and
the run records them in run.json; the config stays as resolved), so the base weights go
through optim.py's freezing (multi_transform with set_to_zero: bitwise unchanged, no
optimizer state) and the header shows the split.
`init.path` of a plain run or export loads the base weights and keeps the
adapters' fresh init (`is_adapter`); `python -m jtrain.export --merge_lora` writes
`W + alpha/r * A @ B` (`merge`), which the plain model loads.

Merging needs every adapted weight to enter its matmul as stored with its input axes
first, as in flax's Dense / DenseGeneral / Linear / Einsum / Conv layers and the built-in
transformer. A weight used otherwise (transposed, as a tied output embedding is) would
merge wrongly: that is a ConfigError naming it before the first step.

qwix (pinned 0.1.8, `pip install 'jtrain[lora]'`) is imported only when LoRA is on. Its
LoraProvider is used with its two matmul paths redone from qwix's own helpers
(`_provider_class`): its einsum path sets an attribute on the module, which a Linen
module refuses outside setup() (SetAttributeFrozenModuleError), and both paths find the
weight of a matmul by matching shapes under jax.grad, which fails or adapts nothing for
same-shaped weights in one module (query / key / value). Here the weight is found by
following the trace back to the module's parameter, and its layout is recorded.
`x @ w` is routed through dot_general (jnp.matmul's inner jit would hide the weight).
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jtrain import internals, optim
from jtrain.errors import ConfigError
from jtrain.models import adapters
from jtrain.models.adapters import is_nnx, nnx  # flax.nnx imported at first NNX use

ADAPTERS = r"_lora_[ab]$"  # the parameter paths that train (an optim.trainable regex)
_A, _B = "_lora_a", "_lora_b"
# Primitives between a stored weight and its matmul that keep the weight's layout.
_SAME_LAYOUT = frozenset({"convert_element_type", "sharding_constraint", "copy", "copy_p",
                          "reshard", "mesh_cast"})


def is_adapter(path: str) -> bool:
    """Is the parameter path (`.../kernel_lora_a`) a LoRA adapter?"""
    return re.search(ADAPTERS, path) is not None


def to_model_fns(module, cfg, sample, mesh):
    """(ModelFns, extra trainable patterns): `adapters.to_model_fns(module, mesh)` and ()
    when `finetune.lora.rank` is 0; else the model with adapters on the targeted weights
    and (ADAPTERS,), the patterns the optimizer adds to optim.trainable so that only
    they train. `sample`: one example's model inputs.
    Raises ConfigError for a target regex that adapts nothing, a weight that could not
    be merged, or a rank above every adapted weight's dimensions."""
    lora = cfg.finetune.lora
    if lora.rank == 0:
        return adapters.to_model_fns(module, mesh), ()
    if not lora.alpha > 0:
        raise ConfigError("finetune.lora.alpha", f"must be > 0, got {lora.alpha!r}")
    try:
        re.compile(lora.targets)
    except re.error as e:
        raise ConfigError("finetune.lora.targets",
                          f"bad regex {lora.targets!r}: {e}") from None
    try:
        # qwix's rule takes every module: the targets are matched on each weight's
        # parameter path (Provider._adapt), the convention of every parameter pattern.
        provider = _provider_class()(lora.targets, module_path=".*", rank=lora.rank,
                                     alpha=float(lora.alpha))
    except ImportError as e:
        raise ConfigError("finetune.lora.rank", f"LoRA needs qwix ({e}): pip install "
                                                "'jtrain[lora]'") from None
    fns = adapters.to_model_fns(_wrap(module, provider, sample, cfg.seed), mesh)
    _check(provider, fns, sample, mesh, lora, cfg.data.batch_size)
    return fns, (ADAPTERS,)


def _wrap(module, provider, sample, seed):
    """The model with qwix's LoRA interception: a Linen module copy, an NNX instance
    (its weights kept, fresh adapters), or an NNX factory whose models get adapters."""
    import qwix

    if isinstance(module, nn.Module):
        return qwix.apply_lora_to_model(module, provider)
    if is_nnx(module):
        return _nnx_lora(module, provider, sample, nnx.Rngs(seed))
    if isinstance(module, (tuple, list)):
        raise ConfigError("finetune.lora.rank", "LoRA adapts the matmul weights of Flax "
                          "modules (Linen or NNX); an (init, apply) pair has none")
    if is_nnx(module, cls=True):
        module = adapters.nnx_class_factory(module)
    elif isinstance(module, type) or not callable(module):
        return module  # not a model: adapters.to_model_fns says why
    factory = module  # a function rngs -> nnx.Module

    def lora_factory(rngs):
        return _nnx_lora(factory(rngs), provider, sample, rngs)

    lora_factory.__name__ = lora_factory.__qualname__ = getattr(factory, "__name__", "model")
    return lora_factory


def _nnx_lora(model, provider, sample, rngs):
    """qwix runs an NNX model once (one example) to create its adapters."""
    import qwix

    inputs = jax.tree.map(lambda x: jnp.asarray(x)[None], sample)
    return qwix.apply_lora_to_model(model, provider, inputs, rngs=rngs,
                                    **adapters._mode_kwargs(type(model).__call__, False))


def _check(provider, fns, sample, mesh, lora, batch_size):
    """Traces the adapted model (shapes only), as evaluated and as differentiated by the
    train step, and checks what the provider saw."""
    inputs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        (batch_size,) + np.shape(x), np.asarray(x).dtype), sample)

    def total(p, x):  # what a train step differentiates, in short; in train mode a
        # model's state (BatchNorm statistics) is updated, so it is applied mutable
        out, _ = fns.apply(p, x, jax.random.key(0), True, mutable=True)
        return sum(jnp.sum(jnp.asarray(y, jnp.float32)) for y in jax.tree.leaves(out))

    with jax.set_mesh(mesh):
        params = fns.existing_params
        if params is None:
            params = jax.eval_shape(lambda rng, x: nn.unbox(fns.init(rng, x)),
                                    jax.random.key(0), inputs)
        adapted = []
        for fn in (lambda p, x: fns.apply(p, x), jax.grad(total)):
            provider.adapted = set()
            jax.eval_shape(fn, params, inputs)
            adapted.append(provider.adapted)
    differ = sorted(adapted[0] ^ adapted[1])  # the step would train another model
    if differ:
        raise ConfigError("finetune.lora.targets", f"{differ[0]}: adapted when evaluated "
                          "but not when differentiated, or the other way round; leave its "
                          "module out of finetune.lora.targets")
    if not provider.layouts:
        optim.check_patterns("finetune.lora.targets", [lora.targets], sorted(provider.seen),
                             "parameter path of a matmul weight")
        raise ConfigError("finetune.lora.targets", f"{lora.targets!r}: no matmul weight it "
                                                   "matches could be adapted")
    for path, why in sorted(provider.layouts.items()):
        if why:
            raise ConfigError("finetune.lora.targets", f"{path} {why}, so its adapter could "
                              "not be merged into it (--merge_lora); leave its module out of "
                              "finetune.lora.targets")
    shapes = {jax.tree_util.keystr(k, simple=True, separator="/"): v.shape
              for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    # A rank above a weight's smaller side is no longer low-rank (a small head can be
    # that); above every adapted weight's, the setting is a mistake.
    dims, path = max((min(math.prod(shapes[p + _A][:-1]), math.prod(shapes[p + _B][1:])), p)
                     for p in provider.layouts)
    if lora.rank > dims:
        raise ConfigError("finetune.lora.rank", f"{lora.rank} is above the dimensions of "
                          f"every adapted weight (the largest: {dims}, {path} "
                          f"{shapes[path]}); use a rank <= {dims}")


def _find_weight(rhs, candidates: dict):
    """(name, as_stored) of the weight in `candidates` ({name: value}) that the traced
    matmul operand `rhs` comes from through one-input operations; `as_stored`: only
    layout-keeping ones (dtype casts, sharding constraints). (None, None) when `rhs`
    cannot be traced back (a concrete array, an inner jit)."""
    by_id = {id(internals.trace_primal(v)): name for name, v in candidates.items()}
    x, as_stored = internals.trace_primal(rhs), True
    while id(x) not in by_id:
        made = internals.trace_producer(x)
        if made is None or len(made[1]) != 1:
            return None, None
        as_stored &= made[0] in _SAME_LAYOUT
        x = made[1][0]
    return by_id[id(x)], as_stored


@functools.cache
def _provider_class():
    """qwix's LoraProvider with its two matmul paths redone from qwix's own helpers
    (built on first use: qwix is an optional dependency). The weight of a matmul is
    found by following the trace back to the module's parameter, also under jax.grad
    (qwix's find_param then falls back to matching shapes, which fails or picks none
    for same-shaped weights such as query / key / value), and each adapted weight's
    layout is recorded for merging."""
    import qwix

    q = internals.qwix_lora()
    internals.check_trace_walk()

    class Provider(qwix.LoraProvider):
        def __init__(self, targets: str, **rule):
            super().__init__(**rule)
            self.targets = re.compile(targets)  # searched in a weight's parameter path
            self.layouts = {}  # adapted weight path -> None, or why it cannot be merged
            self.adapted = set()  # the weight paths adapted (since the caller reset it)
            self.seen = set()  # the parameter paths of matmul weights

        def _targeted(self, name: str) -> str | None:
            """The parameter path of the current module's weight `name`, when the
            targets match it."""
            path = "/".join((*map(str, q.module_path()), name))
            return path if self.targets.search(path) else None

        def _adapt(self, op, rhs, inputs_first: bool):
            """(rule, weight name) when the matmul operand `rhs` is a weight to adapt,
            else None; notes the weight's layout."""
            module = q.module()
            if isinstance(module, nn.Module):
                stored = module.variables.get("params", {})
            else:
                stored = {k: v for k, v in vars(module).items() if isinstance(v, nnx.Param)}
            name, as_stored = _find_weight(rhs, {k: q.unbox(v) for k, v in stored.items()})
            if name is None and not isinstance(rhs, jax.core.Tracer):
                name = q.find_param(rhs, q.with_aux)  # eager: qwix's own search
            if name is None or is_adapter(name):
                return None
            self.seen.add("/".join((*map(str, q.module_path()), name)))
            rule = internals.qwix_rule(self, op)
            path = self._targeted(name)
            if not isinstance(rule, qwix.LoraRule) or path is None:
                return None
            self.adapted.add(path)
            if isinstance(rhs, jax.core.Tracer) and not self.layouts.get(path):
                self.layouts[path] = None if inputs_first and as_stored else (
                    "enters a matmul transposed, reshaped or with its input axes last")
            return rule, name

        def get_intercept_map(self):
            # `x @ w` and jnp.matmul are jitted functions: a dot_general inside them is
            # in an inner trace, where adapters cannot be created. A matrix `w` goes
            # through dot_general here, in the model's own trace.
            return super().get_intercept_map() | dict.fromkeys(internals.matmul_paths(),
                                                               self.matmul)

        def conv_general_dilated(self, lhs, rhs, *args, **kwargs):
            # qwix's own conv path adapts whatever its rule takes (every module here):
            # only a targeted weight gets adapters, as in _adapt.
            name = q.find_param(rhs, q.with_aux)
            if name is None or is_adapter(name) or self._targeted(name) is None:
                return qwix.PtqProvider.conv_general_dilated(self, lhs, rhs, *args, **kwargs)
            return super().conv_general_dilated(lhs, rhs, *args, **kwargs)

        def matmul(self, a, b, **kwargs):
            if jnp.ndim(a) >= 1 and jnp.ndim(b) == 2:
                return self.dot_general(a, b, (((jnp.ndim(a) - 1,), (0,)), ((), ())),
                                        kwargs.get("precision"),
                                        kwargs.get("preferred_element_type"))
            return jnp.matmul(a, b, **kwargs)

        def dot_general(self, lhs, rhs, dimension_numbers, precision=None,
                        preferred_element_type=None, out_sharding=None):
            res = qwix.PtqProvider.dot_general(self, lhs, rhs, dimension_numbers, precision,
                                              preferred_element_type,
                                              out_sharding=out_sharding)
            (lhs_ca, rhs_ca), (lhs_ba, rhs_ba) = dimension_numbers
            found = self._adapt("dot_general", rhs, not rhs_ba and tuple(rhs_ca) == tuple(
                range(len(rhs_ca))))
            if found is None:
                return res
            rule, name = found
            rhs_ra = tuple(i for i in range(rhs.ndim) if i not in (*rhs_ca, *rhs_ba))
            contract, batch, remain = (tuple(rhs.shape[i] for i in axes)
                                       for axes in (rhs_ca, rhs_ba, rhs_ra))
            a_shape, a_axes, b_shape, b_axes = q.layer_shapes(
                rhs_ca, rhs_ba, rhs_ra, contract, batch, remain, rule.rank)
            lora_a, lora_b = q.params(
                name=name, rule=rule, a_shape=a_shape, b_shape=b_shape,
                a_sharding_transpose=a_axes, b_sharding_transpose=b_axes)
            delta = q.delta(lhs, lora_a, lora_b, lhs_ca, lhs_ba, contract, batch, remain,
                            rule.rank, precision=precision)
            return res + delta * (rule.alpha / rule.rank)

        def einsum(self, einsum_str, *operands, **kwargs):
            # Not LoraProvider.einsum: it sets an attribute on the module, which a Linen
            # module refuses outside setup() (SetAttributeFrozenModuleError).
            res = qwix.PtqProvider.einsum(self, einsum_str, *operands, **kwargs)
            if len(operands) != 2:
                return res
            lhs, rhs = operands
            info = q.parse_einsum(einsum_str, ndims=(lhs.ndim, rhs.ndim))
            a_shape, b_shape, lora_str, a_axes, b_axes = q.einsum_shapes(
                lhs.shape, rhs.shape, einsum_str, internals.qwix_rank(self))
            a_str, b_str = lora_str.split("->")[0].split(",")[1:]
            found = self._adapt("einsum", rhs, a_str[:-1] + b_str[1:] == info.rhs)
            if found is None:
                return res
            rule, name = found
            lora_a, lora_b = q.params(
                name=name, rule=rule, a_shape=a_shape, b_shape=b_shape,
                a_sharding_transpose=a_axes, b_sharding_transpose=b_axes)
            return res + jnp.einsum(lora_str, lhs, lora_a, lora_b, **kwargs) * (
                rule.alpha / rule.rank)

    return Provider


def merge(tensors: dict, rank: int, alpha: float) -> tuple[dict, list[str]]:
    """(tensors with every `<w>_lora_a` / `<w>_lora_b` pair folded into `<w>` as
    `W + alpha/rank * A @ B` and dropped, the merged names). Raises ValueError for an
    adapter without its partner or base weight, or shapes that do not fit."""
    out = {k: v for k, v in tensors.items() if not is_adapter(k)}
    merged = []
    for name in sorted(tensors):
        if not name.endswith(_A):
            continue
        base = name[:-len(_A)]
        a, b, w = tensors[name], tensors.get(base + _B), tensors.get(base)
        if b is None or w is None:
            raise ValueError(f"{name}: no {base + _B if b is None else base} beside it")
        if a.shape[-1] != rank or b.shape[0] != rank or \
                math.prod(a.shape[:-1]) * math.prod(b.shape[1:]) != w.size:
            raise ValueError(f"{base}: adapters {a.shape} and {b.shape} do not fit the "
                             f"weight {w.shape} at rank {rank}")
        # Inputs-first layout (checked at training): A's rows are W's leading axes.
        delta = a.reshape(-1, rank).astype(np.float64) @ b.reshape(rank, -1).astype(np.float64)
        out[base] = (w.astype(np.float64) + (alpha / rank) * delta.reshape(w.shape)
                     ).astype(w.dtype)
        merged.append(base)
    return out, merged
