"""One section of the config on its own, for the public pieces (`jtrain.make_optimizer`,
`make_mesh`, `make_policy`, `make_model`): a partial dict or ConfigDict is completed
with the schema's defaults and checked, `section("optim", {"lr": 0.1}, total_steps=10)`.
An unknown key or a bad value is a ConfigError naming it (`optim.lrr: unknown key; did
you mean "lr"?`); a section of a resolved config comes back with the same values. The
rules between sections (the batch against grad_accum_steps, the mesh against the
devices) are `jtrain.config.validate`'s, for a whole config.
"""

from __future__ import annotations

import ml_collections

import jtrain.config as config_lib
from jtrain.config.schema import SCHEMA
from jtrain.errors import ConfigError

# Sections whose rules go beyond one key: name -> check(section dict, context).
_CHECKS = {
    "mesh": lambda mesh, context: config_lib.check_mesh(mesh),
    "optim": lambda optim, context: config_lib.check_optim(optim, context["total_steps"]),
}


def section(name: str, partial=None, **context) -> ml_collections.ConfigDict:
    """The `name` section: `partial` (dict, ConfigDict or None)
    over the schema's defaults, checked. `context`: the other values its rules need
    (`total_steps` for optim)."""
    if name == "model":
        return config_lib.resolve_model(_as_dict(name, partial))
    schema = SCHEMA.get(name)
    if not isinstance(schema, dict):
        raise ConfigError(name, f"not a config section; one of: "
                                f"{', '.join(k for k, v in SCHEMA.items() if isinstance(v, dict))}")
    merged = config_lib._build(schema)
    config_lib._overlay(merged, _as_dict(name, partial), schema, prefix=f"{name}.")
    if name == "optim":
        config_lib.optim_kwargs(merged)
    config_lib._validate_tree(merged, schema, prefix=f"{name}.")
    for key, value in context.items():  # top-level keys of their own (total_steps)
        field = SCHEMA[key]
        config_lib._check_value(key, field.type, field.check, value)
    if name in _CHECKS:
        _CHECKS[name](merged, context)
    return ml_collections.ConfigDict(merged)


def _as_dict(name: str, partial) -> dict:
    if partial is None or isinstance(partial, (dict, ml_collections.ConfigDict)):
        return config_lib._as_dict(partial)
    raise ConfigError(name, f"must be a dict or ConfigDict of the {name} section's keys, "
                            f"got {type(partial).__name__}")
