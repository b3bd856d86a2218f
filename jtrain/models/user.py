"""Your own model from a config: `model.name = "user"`, `model.factory =
"package.module:function"`, `model.kwargs = {...}`.

`function(**kwargs)` returns what `jtrain.train(model=...)` accepts: a Flax Linen module,
an NNX module (or a class / function rngs -> NNX module), or an `(init, apply)` pair.
A factory that takes `dtype` / `param_dtype` keyword arguments (and was not given them
in `model.kwargs`) receives the precision policy's. Because the config names the
factory, every command rebuilds the same model from `config.json`: the CLI with
`--config.model.kwargs...` overrides, `python -m jtrain.evaluate`, `init.path`.
"""

from __future__ import annotations

import inspect

from jtrain.errors import ConfigError


def build(model_cfg, *, dtype, param_dtype):
    from jtrain.config.named import call_factory, load_named

    factory = load_named(model_cfg.factory, "model.factory", ConfigError)
    kwargs = dict(model_cfg.kwargs)
    try:
        accepted = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        accepted = {}
    for name, value in (("dtype", dtype), ("param_dtype", param_dtype)):
        if name in accepted and name not in kwargs:
            kwargs[name] = value
    model = call_factory("model", factory, model_cfg.factory, kwargs, dict(model_cfg.kwargs))

    from jtrain.models.adapters import model_kind_error

    why = model_kind_error(model)
    if why:
        raise ConfigError("model.factory", f"{model_cfg.factory}(**{dict(model_cfg.kwargs)})"
                                           f" returned no model: {why}")
    return model


def flops_per_example(model_cfg, input_shape):
    del model_cfg, input_shape
    return None  # a model may declare `flops_per_example` itself (jtrain.observe.perf)
