"""Built-in model families, chosen by `config.model.name` from a plain dict.

Each family is one file with `build(model_cfg, *, dtype, param_dtype) -> nn.Module`,
`DEFAULTS` (its config fields) and `flops_per_example(model_cfg, input_shape)`.
To add a family: write the file and add it to both dicts below.
"""

from __future__ import annotations

from flax import linen as nn

from jtrain.models import mlp, transformer

MODELS = {"transformer": transformer.build, "mlp": mlp.build}
_FAMILIES = {"transformer": transformer, "mlp": mlp}


def _family(model_cfg_or_name):
    if isinstance(model_cfg_or_name, str):
        name = model_cfg_or_name
    elif "name" in model_cfg_or_name:
        name = model_cfg_or_name["name"]
    else:
        raise ValueError(f"model.name: missing; choose one of: {', '.join(sorted(MODELS))}")
    if name not in MODELS:
        raise ValueError(f"model.name: unknown model {name!r}; "
                         f"choose one of: {', '.join(sorted(MODELS))}")
    return name


def make_model(model_cfg, *, dtype, param_dtype) -> nn.Module:
    """The module for `model_cfg.name`; params in `param_dtype`, matmuls in `dtype`."""
    return MODELS[_family(model_cfg)](model_cfg, dtype=dtype, param_dtype=param_dtype)


def flops_per_example(model_cfg, input_shape) -> float | None:
    """Training FLOPs (forward + backward) per example; `input_shape` has no batch axis.

    None would mean "unknown" (a family without a formula); every built-in has one.
    """
    return _FAMILIES[_family(model_cfg)].flops_per_example(model_cfg, input_shape)


def default_model_config(name: str) -> dict:
    """{"name": name, **the family's DEFAULTS}: a fresh dict, safe to modify."""
    return {"name": name, **_FAMILIES[_family(name)].DEFAULTS}
