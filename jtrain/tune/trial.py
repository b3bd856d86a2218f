"""One trial of a search: its parameters sampled from `tune.space`, its config, its run in
its own jtrain workdir (`jtrain.train`, which resumes from the workdir's newest
checkpoint), every eval reported to the pruner through the `on_eval` hook, and its
outcome. Every process of a multi-process worker runs the same trial: the job (number,
workdir, parameters) comes from process 0, and a prune decision is `on_eval`'s, which
jtrain takes on process 0 and applies on every process at the same step.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import numbers
import os
import re

from jtrain import errors, paths
from jtrain.config import space as space_lib
from jtrain.observe import jsonl

PRIMITIVES = (type(None), bool, int, float, str)


@dataclasses.dataclass
class Outcome:
    state: str  # complete | pruned | failed | interrupted
    value: float | None = None
    step: int | None = None
    reason: str = ""
    fatal: errors.JtrainError | None = None  # a tune.* config error: ends the study


def suggest(trial, space: dict) -> dict:
    """{dotted key: value} sampled (or, for a continued trial, re-read) from the space."""
    params = {}
    for key, spec in space_lib.flatten(space).items():
        kind = spec[0]
        if kind in ("log_uniform", "uniform"):
            params[key] = trial.suggest_float(key, spec[1], spec[2], log=kind == "log_uniform")
        elif kind in ("int", "log_int"):
            params[key] = trial.suggest_int(key, spec[1], spec[2], log=kind == "log_int")
        else:
            choices = list(spec[1])
            if all(isinstance(c, PRIMITIVES) for c in choices):
                params[key] = trial.suggest_categorical(key, choices)
            else:  # Optuna stores primitives only: tuples (e.g. model.hidden) by their repr
                names = [repr(c) for c in choices]
                params[key] = choices[names.index(trial.suggest_categorical(key, names))]
    # A continued trial's values are the database's (fixed params): held to the space too.
    return checked_params(space, params, f"trial {trial.number}")


def checked_params(space: dict, params: dict, where: str) -> dict:
    """`params` (decoded) when every key is a key of the space and every value one it can
    take: the type its kind declares, inside its range or among its choices. A study's
    database is someone else's data: anything else would reach a trial's config and
    best_config.py (a factory path, a command), so it is one WorkdirError naming the
    trial and the key."""
    flat = space_lib.flatten(space)
    for key, value in params.items():
        spec = flat.get(key)
        name = f"study {where}: params[{key!r}]"
        if spec is None:
            raise errors.WorkdirError(name, "not a key of tune.space: a study's database "
                                      "holds only values of the space; refused")
        if not _in_space(spec, value):
            raise errors.WorkdirError(name, f"{value!r} is not a value of tune.space's "
                                      f"{tuple(spec)!r}; refused")
    return params


def _in_space(spec, value) -> bool:
    kind = spec[0]
    if kind == "choice":  # the same type too: True is not 1, "1" is not 1
        return any(type(value) is type(c) and value == c for c in spec[1])
    want = numbers.Integral if kind in ("int", "log_int") else numbers.Real
    return (isinstance(value, want) and not isinstance(value, bool)
            and math.isfinite(value) and spec[1] <= value <= spec[2])


_TRIAL_DIR = re.compile(r"(trials|populations)/(0|[1-9][0-9]{0,9})")


def trial_rel(rel) -> str:
    """A trial's folder as the study records it (trials/<n>, populations/<n>), rebuilt
    from its number; anything else read from the database is one WorkdirError."""
    m = _TRIAL_DIR.fullmatch(rel) if isinstance(rel, str) else None
    if m is None:
        raise errors.WorkdirError(f"study trial workdir {rel!r}", "not trials/<number> "
                                  "or populations/<number>: jtrain names a trial's folder "
                                  "by its number; refused")
    return f"{m.group(1)}/{int(m.group(2))}"


def decode(space: dict, params: dict) -> dict:
    """Stored Optuna params -> config values (a tuple choice is stored as its repr)."""
    flat, out = space_lib.flatten(space), {}
    for key, value in params.items():
        spec = flat.get(key)
        if spec is not None and spec[0] == "choice" and isinstance(value, str):
            by_name = {repr(c): c for c in spec[1] if not isinstance(c, PRIMITIVES)}
            value = by_name.get(value, value)
        out[key] = value
    return out


def trial_config(base: dict, params: dict, keep_tune: bool = True) -> dict:
    """The base config with the sampled values at their dotted keys. A trial keeps `tune`
    (its run checks tune.monitor before the first step); best_config.py leaves it out
    (tune.* never changes what a run trains)."""
    config = copy.deepcopy({k: v for k, v in base.items() if keep_tune or k != "tune"})
    for key, value in params.items():
        node = config
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return config


def trial_dir(root: str, rel: str) -> str:
    """The run directory of a trial: `rel` (trials/<n>, checked by `trial_rel`) under
    the search's workdir, a path (confined: no link out of it) or a URI
    (s3://bucket/study -> s3://bucket/study/trials/<n>)."""
    from jtrain.checkpoint import store

    rel = trial_rel(rel)
    if store.is_remote(root):
        return store.join(root, rel)
    return paths.confined(root, rel, f"study trial workdir {rel!r}")


def last_checkpoint(workdir: str) -> int | None:
    """The newest finished checkpoint step in a trial's workdir (what a rerun resumes):
    on an object store (s3://...), the newest step committed in the bucket."""
    from jtrain.checkpoint import store
    from jtrain.checkpoint.integrity import MANIFEST

    if store.is_remote(workdir):
        steps = store.committed(workdir)
        return steps[-1] if steps else None

    root = os.path.join(workdir, "checkpoints")
    try:  # a finished save has our manifest (written before it is renamed into place)
        steps = [int(n) for n in os.listdir(root)
                 if n.isdigit() and os.path.exists(os.path.join(root, n, MANIFEST))]
    except FileNotFoundError:
        return None
    return max(steps) if steps else None


def run(base: dict, params: dict, workdir: str, monitor: str, report=None) -> Outcome:
    """Trains the trial in `workdir` (a path, or a URI: s3://bucket/study/trials/<n>).
    `report(step, value) -> prune?` (process 0 only)."""
    def on_eval(step, metrics):
        value = metrics.get(monitor)
        return bool(report(step, float(value))) if report and value is not None else False

    return train(trial_config(base, params), workdir, on_eval, [monitor])[0]


def train(config: dict, workdir: str, on_eval, monitors: list[str]) -> list[Outcome]:
    """One jtrain run in `workdir` and the outcome of each of `monitors` (one per trial
    it trains: a population run trains several, jtrain.tune.batch)."""
    import jtrain

    n = len(monitors)
    try:
        result = jtrain.train(config, workdir, on_eval=on_eval)
    except errors.ConfigError as e:
        if e.key.startswith("tune."):  # the study's own config: no trial can succeed
            return [Outcome("failed", reason=errors.render(e), fatal=e)] * n
        return [Outcome("failed", reason=errors.render(e))] * n
    except errors.JtrainError as e:  # a bad value for this trial, a non-finite halt, ...
        return [Outcome("failed", reason=errors.render(e))] * n
    except Exception as e:  # noqa: BLE001 - e.g. a user model failing for some params
        return [Outcome("failed", reason=errors.render(e))] * n
    step = result.summary.get("step")
    if result.stopped_by in ("SIGTERM", "SIGINT"):
        return [Outcome("interrupted", step=step, reason=f"stopped by {result.stopped_by}")
                for _ in monitors]
    out = []
    for monitor in monitors:
        value = final_value(workdir, monitor)
        if result.stopped_by == "on_eval":
            out.append(Outcome("pruned", value=value, step=step))
        elif value is None or not math.isfinite(value):
            out.append(Outcome("failed", step=step, reason=f"jtrain: tune: {monitor} at the "
                               f"last eval is {value} (no finite value to rank)"))
        else:
            out.append(Outcome("complete", value=value, step=step))
    return out


def final_value(workdir: str, monitor: str) -> float | None:
    """The monitor at the run's last eval, from metrics.jsonl (evals of earlier sessions
    of a resumed run included); on an object store, the bucket's metrics.jsonl."""
    from jtrain.checkpoint import store

    if store.is_remote(workdir):
        data = store.read_bytes(store.join(workdir, "metrics.jsonl"))
        records = jsonl.parse_records(data or b"")
    else:
        records = jsonl.read_records(os.path.join(workdir, "metrics.jsonl"))
    values = [r[monitor] for r in records if monitor in r]
    return float(values[-1]) if values else None
