"""Keys renamed or taken out of the config, and what an old name becomes. An old name
keeps working for two minor releases (docs/compatibility.md): `resolve` moves its value
to the new key and the run prints one line naming both, so a run directory's config.json
of an older release resumes, evaluates and exports; config.json records the new names.
An override of an old name on the command line (`--config.optim.muon_beta=0.9`) is a
config error naming the new key."""

from __future__ import annotations

# old dotted key -> new dotted key
MOVED = {
    "deterministic": "determinism.gpu_ops",
    "checkpoint.init_from": "init.path",
    "checkpoint.init_from_step": "init.step",
    "checkpoint.init_from_opt": "init.opt",
    "checkpoint.init_into": "init.into",
    "checkpoint.init_exclude": "init.exclude",
    "checkpoint.init_map": "init.map",
}
# a built-in optimizer's old key -> (that optimizer, its argument in optim.kwargs); the
# value of another optimizer's key was never read and is dropped.
OPTIM_ARGS = {
    "optim.muon_beta": ("muon", "beta"),
    "optim.muon_ns_steps": ("muon", "ns_steps"),
    "optim.prodigy_d0": ("prodigy", "estim_lr0"),
    "optim.momentum": ("sgd", "momentum"),
    "optim.nesterov": ("sgd", "nesterov"),
}
# keys that left the config -> where their setting is now
GONE = {
    "eval.async_nice": "the environment variable JTRAIN_EVAL_NICE",
    "eval.async_cpus": "the environment variable JTRAIN_EVAL_CPUS",
    "checkpoint.writer_nice": "the environment variable JTRAIN_WRITER_NICE",
    "population.data": "nowhere: every member sees the same batches",
}


def new_name(key: str) -> str | None:
    """Why an old dotted `key` is not a key any more (`renamed to init.path`), or None."""
    if key in MOVED:
        return f"renamed to {MOVED[key]}"
    if key in OPTIM_ARGS:
        name, arg = OPTIM_ARGS[key]
        return f"renamed to optim.kwargs.{arg} (with optim.name={name!r})"
    if key in GONE:
        return f"no longer a config key; set {GONE[key]}"
    return None


def apply(user: dict) -> tuple[dict, str | None]:
    """`user` (a nested dict) with every old key moved to its new place (a copy of each
    section it changes), and one note line naming them, or None when there was none."""
    out = dict(user)
    done = []
    for old in (*MOVED, *OPTIM_ARGS, *GONE):
        section, _, leaf = old.rpartition(".")
        node = out.get(section) if section else out
        if not isinstance(node, dict) or leaf not in node:
            continue
        node = dict(node)
        value = node.pop(leaf)
        if section:
            out[section] = node
        else:
            out = node
        if old in MOVED:
            _put(out, MOVED[old], value)
            done.append(f"{old} -> {MOVED[old]}")
        elif old in OPTIM_ARGS:
            name, arg = OPTIM_ARGS[old]
            if node.get("name", "adamw") == name:
                node["kwargs"] = {arg: value, **dict(node.get("kwargs") or {})}
            done.append(f"{old} -> optim.kwargs.{arg}")
        else:
            where = GONE[old]
            done.append(f"{old} -> ${where.split()[-1]}" if "variable" in where else
                        f"{old} dropped")
    if not done:
        return user, None
    return out, ("config: old key names, read as the new ones (write these; the old "
                 "names go in a later release): " + ", ".join(done))


def _put(tree: dict, dotted: str, value) -> None:
    """tree[a][b] = value for "a.b", copying section a (the user's dict is not changed)."""
    section, leaf = dotted.split(".")
    tree[section] = {**dict(tree.get(section) or {}), leaf: value}
