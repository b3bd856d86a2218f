"""The mixed-precision policy and fp16 dynamic loss scaling.

Reads `config.model.dtype`, `config.model.param_dtype`, `config.model.loss_scale`,
`config.model.init_scale`, `config.model.keep_fp32`. Built-in models get
`compute_dtype` / `param_dtype` when they are built and keep norms in float32. Your own
model gets the policy without its cooperation (`cast_apply`, as mixed-precision
libraries do): params stay stored in `param_dtype`; inside the step, floating params
(except paths matching `keep_fp32`) and floating inputs are cast to the compute dtype
before `apply`, and floating outputs back to float32. The default losses (losses.py)
compute in float32 whatever the outputs' dtype.

What the model really computes in is measured after it is built (`matmul_dtypes`: the
dtypes of the traced forward's matmuls); the header reports it, warns when the model's
layers cast back to their own dtype, and summary.json records both (`Policy.record`).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp

from jtrain.config import sections

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# Dynamic loss scaling: halve on overflow, double after this many finite steps in a row.
GROWTH_INTERVAL = 2000


@dataclasses.dataclass(frozen=True)
class Policy:
    param_dtype: jnp.dtype
    compute_dtype: jnp.dtype
    dynamic_loss_scale: bool
    init_scale: float
    # What the traced model computes in: ((dtype name, matmul count), ...), most first;
    # None until measured (see `measure`).
    matmuls: tuple[tuple[str, int], ...] | None = None

    def describe(self) -> str:
        """`params float32, compute bfloat16 (model: 12/12 matmuls bfloat16)`."""
        scale = ", dynamic loss scale" if self.dynamic_loss_scale else ""
        compute = jnp.dtype(self.compute_dtype).name
        measured = ""
        if self.matmuls:
            total = sum(n for _, n in self.matmuls)
            same = dict(self.matmuls).get(compute, 0)
            others = "".join(f"; {n} {name}" for name, n in self.matmuls if name != compute)
            measured = f" (model: {same}/{total} matmuls {compute}{others})"
        return (f"params {jnp.dtype(self.param_dtype).name}, compute {compute}{measured}"
                f"{scale}")

    def warning(self) -> str | None:
        """One line when a reduced-precision policy meets a model whose matmuls run in
        another dtype (its layers cast to their own); None otherwise."""
        compute = jnp.dtype(self.compute_dtype).name
        if not self.matmuls or compute == "float32":
            return None
        total = sum(n for _, n in self.matmuls)
        other = [(name, n) for name, n in self.matmuls if name != compute]
        if not other:
            return None
        name, n = other[0]
        return (f"jtrain: warning: model.dtype={compute}, but the model computes {n} of "
                f"{total} matmuls in {name}: its layers set their own dtype; build it with "
                "dtype=..., or give model.factory a dtype argument")

    def record(self) -> dict:
        """summary.json's "precision": what was configured and what the model computes."""
        return {"params": jnp.dtype(self.param_dtype).name,
                "compute": jnp.dtype(self.compute_dtype).name,
                "dynamic_loss_scale": self.dynamic_loss_scale,
                "measured_matmuls": dict(self.matmuls) if self.matmuls else None}


def make_policy(model_cfg=None, platform: str | None = None) -> Policy:
    """`model.dtype="auto"` means bfloat16 compute on GPU/TPU and float32 on CPU.
    `model_cfg`: the `model` section, whole or partial (`{"dtype": "bfloat16"}`).

    Examples:
        ```python
        import jtrain

        policy = jtrain.make_policy({"dtype": "bfloat16"})
        print(policy.describe())    # params float32, compute bfloat16
        ```
    """
    model_cfg = sections.section("model", model_cfg)
    platform = platform or jax.default_backend()
    name = model_cfg.dtype
    if name == "auto":
        name = "float32" if platform == "cpu" else "bfloat16"
    compute = _DTYPES[name]
    scale = model_cfg.loss_scale
    dynamic = scale == "dynamic" or (scale == "auto" and compute == jnp.float16)
    return Policy(param_dtype=_DTYPES[model_cfg.param_dtype], compute_dtype=compute,
                  dynamic_loss_scale=dynamic,
                  init_scale=float(model_cfg.init_scale))


def cast_apply(apply_fn, policy: Policy, keep_fp32=("norm",)):
    """`apply_fn` computing in `policy.compute_dtype` (see the module doc); `apply_fn`
    itself when the compute dtype is float32 and the params are stored in float32."""
    compute = jnp.dtype(policy.compute_dtype)
    if compute == jnp.float32 and jnp.dtype(policy.param_dtype) == jnp.float32:
        return apply_fn
    keep = [re.compile(p, re.IGNORECASE) for p in keep_fp32]

    def floating(x):
        return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)

    def cast_param(path, x):
        if not floating(x):
            return x
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        return x.astype(jnp.float32 if any(r.search(name) for r in keep) else compute)

    def apply(params, inputs, **kwargs):
        params = jax.tree_util.tree_map_with_path(cast_param, params)
        inputs = jax.tree.map(lambda x: x.astype(compute) if floating(x) else x, inputs)
        out = apply_fn(params, inputs, **kwargs)
        return jax.tree.map(lambda y: y.astype(jnp.float32) if floating(y) else y, out)

    return apply


def matmul_dtypes(apply_fn, params, inputs) -> tuple[tuple[str, int], ...]:
    """((dtype name, count), ...) of the floating matmuls (dot_general, convolutions) in
    the traced forward `apply_fn(params, inputs)` (abstract arguments; nothing runs),
    sub-jaxprs included (jit, scan, cond, remat, custom derivatives); most frequent
    first. A matmul's dtype is its operands' (promoted)."""
    closed = jax.make_jaxpr(lambda p, x: apply_fn(p, x))(params, inputs)
    counts: dict[str, int] = {}
    _count_matmuls(closed.jaxpr, counts)
    return tuple(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


_MATMULS = ("dot_general", "conv_general_dilated")


def _count_matmuls(jaxpr, counts: dict) -> None:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _MATMULS:
            dtypes = [v.aval.dtype for v in eqn.invars[:2]]
            if all(jnp.issubdtype(d, jnp.floating) for d in dtypes):
                name = jnp.dtype(jnp.promote_types(*dtypes)).name
                counts[name] = counts.get(name, 0) + 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                if hasattr(sub, "eqns"):
                    _count_matmuls(sub, counts)


def measured(policy: Policy, matmuls, loss_scale: str = "auto") -> Policy:
    """`policy` with the model's measured matmul dtypes; an automatic float16 loss scale
    is dropped when no matmul computes in float16 (a float32 model needs none)."""
    dynamic = policy.dynamic_loss_scale
    if (dynamic and loss_scale == "auto" and matmuls
            and not dict(matmuls).get(jnp.dtype(jnp.float16).name)):
        dynamic = False
    return dataclasses.replace(policy, matmuls=tuple(matmuls) or None,
                               dynamic_loss_scale=dynamic)


def init_loss_scale(policy: Policy) -> dict:
    """The loss-scale part of the train state: a scale and a count of finite steps."""
    scale = policy.init_scale if policy.dynamic_loss_scale else 1.0
    return {"scale": jnp.asarray(scale, jnp.float32), "good_steps": jnp.asarray(0, jnp.int32)}


def update_loss_scale(loss_scale: dict, grads_finite: jax.Array, dynamic: bool) -> dict:
    """Next loss scale: halve on a non-finite gradient, double after GROWTH_INTERVAL."""
    if not dynamic:
        return loss_scale
    scale, good = loss_scale["scale"], loss_scale["good_steps"]
    grow = grads_finite & (good + 1 >= GROWTH_INTERVAL)
    new_scale = jnp.where(grads_finite, jnp.where(grow, scale * 2.0, scale),
                          jnp.maximum(scale / 2.0, 1.0))
    new_good = jnp.where(grads_finite & ~grow, good + 1, 0)
    return {"scale": new_scale.astype(jnp.float32), "good_steps": new_good.astype(jnp.int32)}


# Deterministic GPU kernels (XLA reads these once, when the backend starts).
DETERMINISTIC_FLAGS = ("--xla_gpu_deterministic_ops=true",
                       "--xla_gpu_exclude_nondeterministic_ops=true")


def set_deterministic(enabled: bool) -> str | None:
    """`determinism.gpu_ops=True`: add the XLA flags for deterministic GPU ops to XLA_FLAGS
    before the backend starts. Returns the header's line (None when off). CPU runs are
    deterministic already; a backend started before train() (arrays created by the
    caller) keeps its flags, and the line says so."""
    if not enabled:
        return None
    import os

    from jtrain import internals

    current = os.environ.get("XLA_FLAGS", "")
    missing = [f for f in DETERMINISTIC_FLAGS if f.split("=")[0] not in current]
    if internals.backends_started():
        if jax.default_backend() == "cpu":
            return "deterministic: on (CPU: already deterministic)"
        if missing:
            return ("deterministic: NOT applied: the backend started before train(); set "
                    f"XLA_FLAGS='{' '.join(DETERMINISTIC_FLAGS)}' before importing jax")
        return "deterministic: on (XLA flags set before start-up)"
    os.environ["XLA_FLAGS"] = " ".join([current, *missing]).strip()
    if jax.default_backend() == "cpu":
        return "deterministic: on (CPU: already deterministic)"
    return f"deterministic: on ({' '.join(DETERMINISTIC_FLAGS)})"
