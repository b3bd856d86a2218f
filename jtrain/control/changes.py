"""Config changes on resume: the diff between a checkpoint's config and the current one,
and which changed keys need `checkpoint.allow_changes`."""

from __future__ import annotations

import fnmatch
import json

from jtrain import config as config_lib


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


_ABSENT = "(absent)"


def config_changes(saved: dict, current: dict) -> dict[str, tuple]:
    """{dotted key: (saved value, current value)} for every key that differs."""
    a, b = flatten(saved), flatten(json.loads(json.dumps(current, default=str)))
    out = {}
    for key in sorted(set(a) | set(b)):
        old, new = a.get(key, _ABSENT), b.get(key, _ABSENT)
        if old != new:
            out[key] = (old, new)
    return out


def schedule_uses_total_steps(config: dict) -> bool:
    optim = config.get("optim", {})
    return optim.get("decay_steps", 0) == 0 and optim.get("schedule") not in ("constant", "rsqrt")


def unallowed_changes(changes: dict, allowed, config: dict) -> list[str]:
    """The changed keys that need `checkpoint.allow_changes` (fnmatch patterns)."""
    out = []
    for key in changes:
        # Keys that cannot change the trained state (config.Field.resume) may differ;
        # they are still recorded.
        if config_lib.resume_safe(key):
            continue
        if key == "total_steps" and not schedule_uses_total_steps(config):
            continue  # extending (or shortening) a run whose schedule ignores it
        if any(fnmatch.fnmatchcase(key, pattern) for pattern in allowed):
            continue
        out.append(key)
    return out


def describe_changes(changes: dict, keys) -> str:
    def show(v):
        return v if v == _ABSENT else json.dumps(v)

    return ", ".join(f"{k} {show(changes[k][0])} -> {show(changes[k][1])}" for k in keys)
