"""What a search leaves in its workdir (process 0 of a worker writes it):

    trials.jsonl    one line per trial: number, state, value, params, step, workdir,
                    reason (failed / interrupted), continues / resumed_from (continued),
                    member (its member of a population run, tune.population > 1)
    best_config.py  get_config() of the best complete trial's values: retrain it with
                    python -m jtrain.main --config=WORKDIR/best_config.py --workdir=...
    tune.png        optimisation history and parameter importances
"""

from __future__ import annotations

import json
import numbers
import os
import pprint

from optuna.trial import TrialState

from jtrain.config import schema as schema_lib
from jtrain.observe import layout
from jtrain.tune import study as study_lib
from jtrain.tune import trial as trial_lib

STATES = {TrialState.COMPLETE: "complete", TrialState.PRUNED: "pruned",
          TrialState.FAIL: "failed", TrialState.RUNNING: "running",
          TrialState.WAITING: "waiting"}


def records(study, space: dict) -> list[dict]:
    out = []
    for t in study.get_trials(deepcopy=False):
        a = t.user_attrs
        if a.get(study_lib.SURPLUS):
            continue  # never ran: a worker asked past the last slot
        state = "interrupted" if study_lib.is_interrupted(t) else STATES.get(t.state, "?")
        # Held to the space and to jtrain's folder names (the database is data).
        params = trial_lib.decode(space, t.params or  # queued: its fixed params
                                  t.system_attrs.get("fixed_params", {}))
        rec = {"number": t.number, "state": state, "value": t.value,
               "params": trial_lib.checked_params(space, params, f"trial {t.number}"),
               "step": a.get(study_lib.STEP, t.last_step),
               "workdir": trial_lib.trial_rel(a.get(study_lib.WORKDIR,
                                                    f"trials/{t.number}"))}
        for key in (study_lib.REASON, study_lib.CONTINUES, study_lib.RESUMED,
                    study_lib.MEMBER):
            if a.get(key) is not None:
                rec[key] = a[key]
        out.append(rec)
    return out


def write_trials(workdir: str, recs: list[dict]) -> str:
    path = os.path.join(workdir, "trials.jsonl")
    _atomic(path, "".join(json.dumps(r, sort_keys=True, default=str) + "\n" for r in recs))
    return path


def best(recs: list[dict], mode: str) -> dict | None:
    done = [r for r in recs if r["state"] == "complete" and r["value"] is not None]
    if not done:
        return None
    sign = 1 if mode == "min" else -1  # ties: the earlier trial
    return min(done, key=lambda r: (sign * r["value"], r["number"]))


def write_best_config(workdir: str, base: dict, rec: dict, monitor: str) -> str:
    """A get_config() file of the best trial's config (the base config with its values).

    Only keys of `tune.space` with values it can take reach it (else one WorkdirError).
    The file is fixed text plus data: every string from the study (params, workdir) or
    the config is in a data literal (VALUES, TRIAL, written by repr), never in the
    docstring or in code; secrets are masked (jtrain.redact), one comment line
    naming each masked key."""
    from jtrain.redact import redact

    # Only the space's keys and values reach the file (checked again: the writer does
    # not trust its caller's record).
    params = trial_lib.checked_params(base["tune"]["space"], rec["params"],
                                      f"trial {rec['number']}")
    trial_lib.trial_rel(rec["workdir"])
    raw = trial_lib.trial_config(base, params, keep_tune=False)
    values = _literal(redact(raw))
    masked = sorted(k for k, v in _flat(values).items() if _flat(_literal(raw)).get(k) != v)
    optional = [k for k, f in schema_lib.describe() if f.type == "optfloat"
                and _get(values, k) is None]
    trial = _literal(redact({"number": rec["number"], "monitor": monitor,
                             "value": rec["value"], "params": rec["params"],
                             "workdir": rec["workdir"], "member": rec.get("member")}))
    lines = ['"""The best trial of a search by python -m jtrain.tune (TRIAL: its number, '
             "the monitored value, its params and workdir).",
             "",
             "    python -m jtrain.main --config=best_config.py --workdir=runs/best",
             "",
             *(["retrains it: with the same devices and steps it ends with the trial's "
                "state_sha256."] if rec.get("member") is None else
               ["retrains it alone: the trial was a member (TRIAL['member']) of the "
                "population run in TRIAL['workdir'], which it matches to float32 rounding."]),
             '"""', "", "from math import inf, nan  # what repr writes for non-finite floats",
             "", "import ml_collections", ""]
    lines += [f"# masked: {ascii(k)}: a secret, set it (--config.{ascii(k)[1:-1]}=...) "
              "before retraining" for k in masked]
    lines += ["TRIAL = " + pprint.pformat(trial, sort_dicts=True, width=88),
              "VALUES = " + pprint.pformat(values, sort_dicts=True, width=88), "", "",
              "def get_config():",
              "    config = ml_collections.ConfigDict(VALUES)"]
    # None-able numbers become typed placeholders, so --config.x=0.5 still works (the
    # keys are the schema's own names).
    lines += [f"    config.{k} = ml_collections.config_dict.placeholder(float)"
              for k in optional]
    lines += ["    return config", ""]
    path = os.path.join(workdir, "best_config.py")
    _atomic(path, "\n".join(lines))
    return path


def _literal(node):
    """`node` as plain data whose repr is a Python literal: dicts (str keys), lists,
    tuples, str, int, float, bool, None; anything else becomes its str."""
    if isinstance(node, dict):
        return {str(k): _literal(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        items = [_literal(v) for v in node]
        return items if isinstance(node, list) else tuple(items)
    if node is None or type(node) in (bool, int, float, str):
        return node
    if isinstance(node, (bool, numbers.Integral)):  # numpy scalars too
        return node if isinstance(node, bool) else int(node)
    if isinstance(node, numbers.Real):
        return float(node)
    return str(node)


def _flat(tree, prefix: str = "") -> dict:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _get(tree: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return "absent"
        tree = tree[part]
    return tree


def write_plot(workdir: str, study, recs: list[dict], monitor: str, mode: str) -> str | None:
    """tune.png: the value of every finished trial with the best so far, and the parameter
    importances (Optuna's default PED-ANOVA evaluator; needs 2+ complete trials)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna

    shown = [r for r in recs if r["state"] in ("complete", "pruned") and r["value"] is not None]
    if not shown:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for state, marker in (("complete", "o"), ("pruned", "x")):
        xs = [r["number"] for r in shown if r["state"] == state]
        ax1.scatter(xs, [r["value"] for r in shown if r["state"] == state], marker=marker,
                    label=state)
    running, best_line = None, []
    for r in sorted(shown, key=lambda r: r["number"]):
        if r["state"] == "complete":
            better = running is None or (r["value"] < running if mode == "min"
                                         else r["value"] > running)
            running = r["value"] if better else running
        best_line.append(running)
    ax1.step([r["number"] for r in sorted(shown, key=lambda r: r["number"])], best_line,
             where="post", label="best so far")
    ax1.set(xlabel="trial", ylabel=monitor, title="optimisation history")
    ax1.legend()
    try:
        importances = optuna.importance.get_param_importances(study)
    except (RuntimeError, ValueError):  # too few complete trials, or no variation
        importances = {}
    if importances:
        names = list(importances)[::-1]
        ax2.barh(names, [importances[n] for n in names])
        ax2.set(xlabel="importance", title="parameter importances")
    else:
        ax2.text(0.5, 0.5, "importances need 2+ complete trials", ha="center")
        ax2.set_axis_off()
    fig.tight_layout()
    path = os.path.join(workdir, "tune.png")
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _atomic(path: str, text: str) -> None:
    layout.write_file(path, text)
