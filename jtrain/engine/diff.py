"""`jtrain diff RUN_A RUN_B` (= `python -m jtrain.diff`): where two runs part.

Compares, in this order:
  config     the resolved configs (config.json): every key whose value differs
  data       the datasets' identity from the newest checkpoints (name, kind, sizes,
             fingerprint)
  versions   python, jtrain, jax, jaxlib, flax, optax, orbax, grain (same record)
  hashes     WORKDIR/hashes.jsonl (`debug.hash_every_steps`): the first step recorded by
             both whose state hash differs, and the first whose example indices differ
  leaf       the checkpoints both runs kept nearest that step (at it, else before it,
             else after it): the first leaf (path order) that differs and its largest
             absolute difference; without hashes, the newest checkpoint both kept.

Checkpoints are read as plain arrays (no model is built), so any two runs compare, on
any machine. Exit codes: 0 identical, 7 they differ, 2 a path that is not a run (one
line). The human lines go to stderr, one JSON line to stdout.
"""

from __future__ import annotations

import os

from jtrain.checkpoint import CheckpointReader
from jtrain.engine.replay import read_run
from jtrain.errors import WorkdirError
from jtrain.observe import hashes as hashes_lib, runfiles

DATA_KEYS = ("name", "kind", "num_examples", "num_eval_examples", "fingerprint")


def diff_runs(run_a: str, run_b: str) -> dict:
    """The comparison above as a dict: {"identical", "config": [{"key", "a", "b"}],
    "data": {...}, "versions": {...}, "hashes": {"compared", "first_step",
    "first_examples_step"}, "leaf": {"step", "path", "max_abs_diff"} | None}.

    Examples:
        ```python
        from jtrain.diff import diff_runs

        d = diff_runs("runs/a", "runs/b")
        if not d["identical"]:
            print(d["config"], d["hashes"]["first_step"], d["leaf"])
        ```
    """
    a, b = os.path.abspath(run_a), os.path.abspath(run_b)
    configs = read_run(a, "RUN_A"), read_run(b, "RUN_B")
    controls = _control(a), _control(b)
    out = {"run_a": a, "run_b": b,
           "config": [{"key": k, "a": x, "b": y} for k, (x, y) in
                      _changed(_flat(configs[0]), _flat(configs[1])).items()],
           "data": _pairs(*({k: c.get("data_info", {}).get(k) for k in DATA_KEYS
                             if k in c.get("data_info", {})} for c in controls)),
           "versions": _pairs(*(c.get("versions", {}) for c in controls))}
    records = [{int(r["step"]): r for r in hashes_lib.read(w)} for w in (a, b)]
    common = sorted(set(records[0]) & set(records[1]))
    first = next((s for s in common if records[0][s]["hash"] != records[1][s]["hash"]),
                 None)
    first_ex = next((s for s in common if records[0][s].get("examples")
                     != records[1][s].get("examples")), None)
    out["hashes"] = {"compared": len(common), "first_step": first,
                     "first_examples_step": first_ex,
                     "parts": None if first is None else sorted(
                         k for k, v in records[0][first].get("parts", {}).items()
                         if records[1][first].get("parts", {}).get(k) != v)}
    out["leaf"] = None if (common and first is None) else _first_leaf(a, b, first)
    out["identical"] = not (out["config"] or out["data"] or out["versions"]
                            or first is not None or first_ex is not None or out["leaf"])
    return out


def _control(workdir: str) -> dict:
    """The run-control record of the newest checkpoint ({} without one)."""
    reader = CheckpointReader(workdir)
    for step in reversed(reader.all_steps()):
        try:
            return runfiles.read_object(os.path.join(reader.directory, str(step), "control",
                                                     "metadata"))
        except (FileNotFoundError, WorkdirError):
            continue  # a damaged step: the next older one
    return {}


def _flat(tree, prefix: str = "") -> dict:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _changed(x: dict, y: dict) -> dict:
    return {k: (x.get(k), y.get(k)) for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)}


def _pairs(x: dict, y: dict) -> dict:
    return {k: {"a": a, "b": b} for k, (a, b) in _changed(x, y).items()}


def _first_leaf(a: str, b: str, first: int | None) -> dict | None:
    """The first differing leaf in the checkpoints both runs kept nearest `first` (None:
    the newest both kept)."""
    readers = CheckpointReader(a), CheckpointReader(b)
    both = sorted(set(readers[0].all_steps()) & set(readers[1].all_steps()))
    if first is None:
        order = both[::-1][:1]
    else:
        order = ([s for s in both if s == first] + [s for s in both if s < first][::-1]
                 + [s for s in both if s > first])
    for step in order:
        trees = [_read_state(r.directory, step) for r in readers]
        found = hashes_lib.first_difference(*trees)
        if found is not None:
            return {"step": step, "path": found[0], "max_abs_diff": found[1]}
    return None


def _read_state(directory: str, step: int) -> dict:
    """A checkpoint's state as {path: numpy array}, without a model (orbax restores
    every leaf as a host array, whatever mesh wrote it)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    path = os.path.join(directory, str(step), "state")
    with ocp.PyTreeCheckpointer() as ck:
        tree = ck.metadata(path).item_metadata.tree
        args = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        out = ck.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))
    return {hashes_lib.leaf_path(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(out)[0]}


def lines(d: dict) -> list[str]:
    """The human summary of `diff_runs`'s result."""
    if d["identical"]:
        h = d["hashes"]["compared"]
        return [f"jtrain: diff: identical ({h} recorded state hashes equal)" if h else
                "jtrain: diff: identical (configs, data, versions and the newest common "
                "checkpoint; no state hashes recorded)"]
    out = []
    for c in d["config"]:
        out.append(f"jtrain: diff: config {c['key']}: {c['a']!r} vs {c['b']!r}")
    for k, v in d["data"].items():
        out.append(f"jtrain: diff: data {k}: {v['a']!r} vs {v['b']!r}")
    for k, v in d["versions"].items():
        out.append(f"jtrain: diff: version of {k}: {v['a']} vs {v['b']}")
    h = d["hashes"]
    if h["first_examples_step"] is not None:
        out.append(f"jtrain: diff: the batches differ first at step {h['first_examples_step']}")
    if h["first_step"] is not None:
        out.append(f"jtrain: diff: the states differ first at step {h['first_step']} "
                   f"(of {h['compared']} steps recorded by both; parts: "
                   f"{', '.join(h['parts'] or []) or '-'})")
    elif not h["compared"]:
        out.append("jtrain: diff: no state hashes recorded by both runs "
                   "(debug.hash_every_steps)")
    leaf = d["leaf"]
    if leaf:
        out.append(f"jtrain: diff: checkpoint {leaf['step']}: first differing leaf "
                   f"{leaf['path']} (max abs diff {leaf['max_abs_diff']:.3g})")
    return out
