"""`tune.space`: the keys a hyperparameter search samples, checked like every other key.

A space maps config keys to a spec, nested like the config or with dotted keys (plain
Python dicts only: an `ml_collections.ConfigDict` refuses dots in names):

    {"optim": {"lr": ("log_uniform", 1e-4, 1e-1), "weight_decay": ("uniform", 0, 0.1)},
     "data": {"batch_size": ("choice", (16, 32, 64))}}

Kinds: `(log_uniform|uniform, lo, hi)` floats, `(int|log_int, lo, hi)` integers (both
ends included), `(choice, (v1, v2, ...))`. Every key must be a config key of the model's
family (or lie under a free-form dict key such as `model.kwargs`), its kind must fit the
key's type, and both ends / every choice must be a valid value of that key. Errors name
`tune.space.<key>`.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from jtrain.config.schema import SPACE_KINDS, Field
from jtrain.config.schema_population import VARY_KEYS
from jtrain.errors import ConfigError

_KINDS_FOR = {int: ("int", "log_int", "choice"), float: ("log_uniform", "uniform", "int",
                                                          "log_int", "choice")}


def is_spec(value) -> bool:
    return isinstance(value, (tuple, list))


def flatten(space, prefix: str = "") -> dict[str, Any]:
    """{dotted key: spec} of a nested or dotted space."""
    out = {}
    for key, value in dict(space).items():
        dotted = f"{prefix}{key}"
        if hasattr(value, "items") and not is_spec(value):
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def nest_dotted(tree: dict) -> dict:
    """A copy of a user config dict whose `tune.space` is nested (dotted keys split), so it
    fits an ml_collections.ConfigDict."""
    tune = tree.get("tune")
    if not isinstance(tune, dict) or not isinstance(tune.get("space"), dict):
        return tree
    nested: dict = {}
    for key, spec in flatten(tune["space"]).items():
        node = nested
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"tune.space.{key}", "given both as a value and as a "
                                  "section")
        node[last] = spec
    return {**tree, "tune": {**tune, "space": nested}}


def check(space, schema: dict, check_value: Callable) -> None:
    """ConfigError naming `tune.space.<key>` for the first bad entry. `check_value(key, type,
    check, value)` is jtrain.config's per-key check."""
    for key, spec in flatten(space).items():
        name = f"tune.space.{key}"
        field = _field(key, schema, name)
        if not is_spec(spec) or not spec or spec[0] not in SPACE_KINDS:
            raise ConfigError(name, "expected (kind, ...) with kind one of "
                              f"{', '.join(SPACE_KINDS)}; got {spec!r}")
        kind = spec[0]
        typ = field.type if field is not None else None
        if typ == "optfloat":
            typ = float
        if typ is not None and kind not in _KINDS_FOR.get(typ, ("choice",)):
            kinds = ", ".join(_KINDS_FOR.get(typ, ("choice",)))
            what = {int: "an integer", float: "a number", bool: "a true/false",
                    str: "a string"}.get(typ, "a list or dict")
            raise ConfigError(name, f"{key} is {what} key: use {kinds}; got {kind!r}")
        values = _values(name, kind, spec)
        if field is not None:
            for v in values:
                check_value(name, field.type, field.check, v)


def _values(name: str, kind: str, spec) -> list:
    """The values a spec can take at its ends (ranges) or all of them (choice)."""
    if kind == "choice":
        if len(spec) != 2 or not is_spec(spec[1]) or not spec[1]:
            raise ConfigError(name, f"expected ('choice', (v1, v2, ...)), got {spec!r}")
        return list(spec[1])
    if len(spec) != 3:
        raise ConfigError(name, f"expected ({kind!r}, lo, hi), got {spec!r}")
    lo, hi = spec[1], spec[2]
    want = int if kind in ("int", "log_int") else (int, float)
    for v in (lo, hi):
        if isinstance(v, bool) or not isinstance(v, want) or not math.isfinite(v):
            what = "integers" if want is int else "finite numbers"
            raise ConfigError(name, f"{kind} bounds must be {what}, got {spec!r}")
    if not lo < hi:
        raise ConfigError(name, f"lo must be < hi, got {spec!r}")
    if kind.startswith("log") and lo <= 0:
        raise ConfigError(name, f"{kind} needs lo > 0, got {spec!r}")
    return [lo, hi]


def _field(key: str, schema: dict, name: str) -> Field | None:
    """The schema field of a dotted key; None below a free-form dict key (model.kwargs.x)."""
    node: Any = schema
    parts = key.split(".")
    for i, part in enumerate(parts):
        if isinstance(node, Field):
            if node.type == "dict":
                return None
            raise ConfigError(name, f"{'.'.join(parts[:i])} is a value, not a section")
        if part not in node:
            import difflib

            close = difflib.get_close_matches(part, list(node), n=1, cutoff=0.6)
            hint = f'; did you mean "{".".join(parts[:i] + [close[0]])}"?' if close else ""
            raise ConfigError(name, f"not a config key{hint}")
        node = node[part]
    if isinstance(node, dict):
        raise ConfigError(name, f"{key} is a section, not a value")
    if key.startswith("tune."):
        raise ConfigError(name, "tune.* keys cannot be searched")
    return node


def check_population(tune: dict) -> None:
    """tune.population > 1 trains trials as the members of one population run: every
    searched key must be one a population can vary (ConfigError naming tune.population)."""
    if tune["population"] <= 1:
        return
    for key in flatten(tune["space"]):
        if key not in VARY_KEYS:
            raise ConfigError("tune.population", f"{tune['population']} trials per "
                              f"population, and a population cannot vary tune.space key "
                              f"{key} (only {', '.join(VARY_KEYS)}); search only those "
                              "keys or set tune.population = 1")
