"""Config changes on resume: the diff between a checkpoint's config and the current one,
and which changed keys need `checkpoint.allow_changes`."""

from __future__ import annotations

import fnmatch
import json

from jtrain.config import schema


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


def saved_config(changes: dict, config: dict) -> dict:
    """The config `changes` were made from (the checkpoint's): `config` (a resolved dict)
    with each changed key's saved value; a key the checkpoint lacked keeps its value."""
    out = json.loads(json.dumps(config, default=str))
    for key, (old, _) in changes.items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and old != _ABSENT:
            node[leaf] = old
    return out


def _keeps_decay_end(changes: dict, config: dict) -> bool:
    """optim.decay_steps changed, the step where the decay ends did not: a run extended
    with its decay pinned where total_steps used to end it (decay_steps 0 -> old
    total_steps) trains on the schedule it saved."""
    saved = saved_config(changes, config)
    ends = [(c.get("optim", {}).get("decay_steps"), c.get("total_steps")) for c in (saved, config)]
    if not all(isinstance(v, int) for pair in ends for v in pair):
        return False
    (d0, t0), (d1, t1) = ends
    return (d0 or t0) == (d1 or t1)


def _new_key_at_its_default(key: str, change: tuple) -> bool:
    """A key the checkpoint's config lacks (it was saved by a jtrain without that key)
    and that now holds its schema default: the saved run did what the default does."""
    old, new = change
    field = schema.field_of(key)
    default = None if field is None else field.default
    if isinstance(default, tuple):
        default = list(default)
    return old == _ABSENT and field is not None and new == default


def unallowed_changes(changes: dict, allowed, config: dict) -> list[str]:
    """The changed keys that need `checkpoint.allow_changes` (fnmatch patterns)."""
    out = []
    for key in changes:
        # Keys that cannot change the trained state (config.Field.resume) may differ;
        # they are still recorded.
        if schema.resume_safe(key):
            continue
        if _new_key_at_its_default(key, changes[key]):
            continue  # saved before the key existed: that run behaved as its default
        if key == "total_steps" and not schedule_uses_total_steps(config):
            continue  # extending (or shortening) a run whose schedule ignores it
        if key == "optim.decay_steps" and _keeps_decay_end(changes, config):
            continue  # the decay ends where it did: the same schedule
        if any(fnmatch.fnmatchcase(key, pattern) for pattern in allowed):
            continue
        out.append(key)
    return out


def describe_changes(changes: dict, keys) -> str:
    def show(v):
        return v if v == _ABSENT else json.dumps(v)

    return ", ".join(f"{k} {show(changes[k][0])} -> {show(changes[k][1])}" for k in keys)
