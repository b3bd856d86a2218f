"""Keys renamed or taken out of the config (docs/compatibility.md): `resolve` moves an
old name's value to the new key, the run prints one line naming both, config.json records
the new name; an old name as a command-line override is a config error naming the new."""

from __future__ import annotations

# old dotted key -> new dotted key; "optim.kwargs.<arg>" only with the optimizer named
# after the arrow (another optimizer never read the old key: its value is dropped);
# "$VAR": an environment variable now (the value is dropped); "": gone.
NEW = {
    "deterministic": "determinism.gpu_ops",
    **{f"checkpoint.{old}": f"init.{new}" for old, new in (
        ("init_from", "path"), ("init_from_step", "step"), ("init_from_opt", "opt"),
        ("init_into", "into"), ("init_exclude", "exclude"), ("init_map", "map"))},
    "optim.muon_beta": "optim.kwargs.beta muon",
    "optim.muon_ns_steps": "optim.kwargs.ns_steps muon",
    "optim.prodigy_d0": "optim.kwargs.estim_lr0 prodigy",
    "optim.momentum": "optim.kwargs.momentum sgd",
    "optim.nesterov": "optim.kwargs.nesterov sgd",
    "eval.async_nice": "$JTRAIN_EVAL_NICE",
    "eval.async_cpus": "$JTRAIN_EVAL_CPUS",
    "checkpoint.writer_nice": "$JTRAIN_WRITER_NICE",
    "population.data": "",  # its one value, shared, is what a population does
    "model_source": "", "loss_source": "",  # older runs' config.json: now in run.json
}


def new_name(key: str) -> str | None:
    """Why the dotted `key` is not a key any more (`renamed to init.path`), or None."""
    new = NEW.get(key)
    if new is None:
        return None
    if new.startswith("$"):
        return f"no longer a config key; set the environment variable {new[1:]}"
    if not new:
        return "no longer a config key"
    new, _, optimizer = new.partition(" ")
    return f"renamed to {new}" + (f" (with optim.name={optimizer!r})" if optimizer else "")


def apply(user: dict) -> tuple[dict, str | None]:
    """(`user` with each old key moved to its new place, the note or None); `user`, a
    nested dict, is left as it was."""
    out, done = dict(user), []
    for old, new in NEW.items():
        section, _, leaf = old.rpartition(".")
        node = out.get(section) if section else out
        if not isinstance(node, dict) or leaf not in node:
            continue
        if section:
            node = out[section] = dict(node)
        value = node.pop(leaf)
        new, _, optimizer = new.partition(" ")
        done.append(f"{old} -> {new or 'dropped'}")
        if new.startswith("optim.kwargs.") and node.get("name", "adamw") != optimizer:
            continue
        if new and not new.startswith("$"):
            *parents, last = new.split(".")
            target = out
            for part in parents:  # copies: the caller's sections stay as they were
                target[part] = dict(target.get(part) or {})
                target = target[part]
            target.setdefault(last, value)  # a new name given too wins
    if not done:
        return user, None
    return out, ("config: old key names, read as the new ones (write these; the old "
                 "names go in a later release): " + ", ".join(done))
