"""Models: the built-in families and the adapters that turn any model into one interface.

    transformer   decoder-only LM over bytes or tokens (RoPE, RMSNorm, logical axes)
    moe           model.moe: the transformer's top-k routed experts, their training terms
    mlp           MLP classifier / regressor
    user          your own model from `model.factory` ("package.module:function")
    adapters      Linen / NNX / pure (init, apply) -> ModelFns (init, apply)
    lora          finetune.lora: LoRA adapters through qwix (only they train), merging
    quant         model.quant: int8 / fp8 quantised training through qwix (QtProvider)

Built-in families are chosen by `config.model.name` from one plain dict, `MODELS`. Each
family module has `build(model_cfg, *, dtype, param_dtype) -> nn.Module` and
`flops_per_example(model_cfg, input_shape)`; its config keys (types, defaults, checks)
are declared in `jtrain.config.MODEL_FAMILIES`. To add a family: write the module, add
it here and its keys there.
"""

from __future__ import annotations

from jtrain import config as config_lib
from jtrain.errors import ConfigError
from jtrain.models import mlp, transformer, user

MODELS = {"transformer": transformer, "mlp": mlp, "user": user}


def _family(model_cfg):
    if "name" not in model_cfg:
        raise ConfigError("model.name", f"missing; choose one of: {', '.join(sorted(MODELS))}")
    name = model_cfg["name"]
    if name not in MODELS:
        raise ConfigError("model.name", f"unknown model {name!r}; "
                                        f"choose one of: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def make_model(model_cfg, *, dtype, param_dtype):
    """The module for `model_cfg.name` (a partial `model` section is completed with the
    schema's defaults and checked); params in `param_dtype`, matmuls in `dtype`.

    Examples:
        ```python
        import jtrain

        mlp = jtrain.make_model({"name": "mlp", "hidden": (16,), "num_outputs": 3},
                                dtype="float32", param_dtype="float32")
        ```
    """
    family = _family(model_cfg)
    return family.build(config_lib.resolve_model(model_cfg), dtype=dtype,
                        param_dtype=param_dtype)


def flops_per_example(model_cfg, input_shape) -> float | None:
    """Training FLOPs (forward + backward) per example; `input_shape` has no batch axis."""
    family = _family(model_cfg)
    return family.flops_per_example(config_lib.resolve_model(model_cfg), input_shape)
