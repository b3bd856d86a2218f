"""A resume that moves the learning-rate schedule's horizon says so: raising total_steps
re-plans a decay that ends at total_steps (the lr jumps back up), and the line under
"resumed from step N" gives the lr before and after and the key that keeps the original
decay; with that key set the run continues the saved schedule bitwise."""

import json
import math
import shutil

from journey import run_python

from jtrain.optim import schedules

SCRIPT = """\
import sys

import numpy as np

import jtrain

rng = np.random.default_rng(0)
x = rng.normal(size=(512, 8)).astype(np.float32)
y = (x[:, :4].sum(1) > x[:, 4:].sum(1)).astype(np.int32)
for run in sys.argv[1:]:  # WORKDIR:TOTAL:DECAY[:ALLOWED_KEY], one run after the other
    workdir, total, decay, *allow = run.split(":")
    print(f"== {workdir}", file=sys.stderr, flush=True)
    config = {"seed": 0, "total_steps": int(total),
              "model": {"name": "mlp", "hidden": (16,), "num_outputs": 2},
              "data": {"batch_size": 16},
              "optim": {"lr": 1e-3, "warmup_steps": 2, "decay_steps": int(decay),
                        "end_lr_factor": 0.1},
              "eval": {"every_steps": 1000, "num_batches": 1},
              "checkpoint": {"every_steps": 1000},
              "log": {"every_steps": 1, "writers": ("jsonl",)}}
    jtrain.train(config, workdir, train_data=(x[:448], y[:448]), eval_data=(x[448:], y[448:]),
                 allow_changes=allow)
"""
LR, WARMUP, END = 1e-3, 2, 0.1


def cosine(step, total):
    """optim.schedule's default (warmup_cosine) written out: linear warmup, then a cosine
    from lr to lr * end_lr_factor at `total`, held there."""
    if step < WARMUP:
        return LR * step / WARMUP
    t = min(step - WARMUP, total - WARMUP) / (total - WARMUP)
    return LR * ((1 - END) * 0.5 * (1 + math.cos(math.pi * t)) + END)


def summary(cwd, run):
    return json.loads((cwd / run / "summary.json").read_text())


def logged_lr(cwd, run):
    rows = [json.loads(line) for line in (cwd / run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/lr"] for r in rows if "train/lr" in r}


def sections(proc) -> dict:
    """{workdir: the stderr lines of its run}, cut at the script's `== WORKDIR` markers."""
    out: dict = {}
    for line in proc.stderr.splitlines():
        if line.startswith("== "):
            out[line[3:]] = []
        elif out:
            out[list(out)[-1]].append(line)
    return out


def test_raising_total_steps_says_what_the_lr_does_and_decay_steps_keeps_it(tmp_path):
    (tmp_path / "run.py").write_text(SCRIPT)
    # A 60-step run stopped part-way (SIGTERM: it saves the step it is at and exits 0).
    proc = run_python(tmp_path, "run.py", "runs/a:60:0", JTRAIN_FAULT="step:30:TERM")
    assert proc.returncode == 0, proc.stderr[-3000:]
    stop = summary(tmp_path, "runs/a")["step"]
    assert 0 < stop < 60
    for run in ("runs/longer", "runs/pinned"):
        shutil.copytree(tmp_path / "runs/a", tmp_path / run)

    # One script, three runs. Resumed with total_steps 120: the decay is re-planned, and
    # the line says so. Resumed with total_steps 120 and the decay pinned at 60: no
    # allow_changes needed, no re-plan. And an uninterrupted run on that schedule.
    proc = run_python(tmp_path, "run.py", "runs/longer:120:0:total_steps",
                      "runs/pinned:120:60", "runs/straight:120:60")
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = sections(proc)
    assert list(said) == ["runs/longer", "runs/pinned", "runs/straight"], proc.stderr[-3000:]
    assert "re-plans the schedule" not in proc.stdout
    lines = said["runs/longer"]
    at = next(i for i, ln in enumerate(lines) if ln.endswith(f"; resumed from step {stop}"))
    assert lines[at + 1] == (
        f"jtrain: total_steps 60 -> 120 re-plans the schedule: lr at step {stop} goes from "
        f"{cosine(stop, 60):.1e} to {cosine(stop, 120):.1e} (set optim.decay_steps=60 to "
        "keep the original decay)")
    # The next update used the new plan (train/lr of step s is the schedule at s - 1).
    assert math.isclose(logged_lr(tmp_path, "runs/longer")[stop + 1], cosine(stop, 120),
                        rel_tol=1e-5)

    # Pinned: resumed (no re-plan line) and every later update's lr is the saved
    # schedule's: bitwise what the uninterrupted run logs, and its state at the end.
    assert any(ln.endswith(f"; resumed from step {stop}") for ln in said["runs/pinned"])
    assert not any("re-plans the schedule" in ln for ln in said["runs/pinned"])
    pinned, straight = logged_lr(tmp_path, "runs/pinned"), logged_lr(tmp_path, "runs/straight")
    assert sorted(straight) == list(range(1, 121))
    assert all(pinned[s] == straight[s] for s in range(stop + 1, 121))
    assert all(math.isclose(pinned[s], cosine(s - 1, 60), rel_tol=1e-6)
               for s in range(stop + 1, 121))
    assert (summary(tmp_path, "runs/pinned")["state_sha256"]
            == summary(tmp_path, "runs/straight")["state_sha256"])


def _config(total, warmup=2, decay=0, schedule="warmup_cosine"):
    return {"total_steps": total, "optim": {"schedule": schedule, "lr": LR,
                                            "end_lr_factor": END, "warmup_steps": warmup,
                                            "decay_steps": decay}}


def test_replan_line_only_when_the_horizon_moves():
    line = schedules.replan_line
    assert line(_config(60), _config(60), 30) is None
    assert line(_config(60), _config(120, decay=60), 30) is None  # pinned: same schedule
    assert line(_config(60, schedule="constant"), _config(120, schedule="constant"), 30) is None
    assert line(_config(60, warmup=5), _config(120, warmup=10), 30) == (
        f"jtrain: total_steps 60 -> 120, optim.warmup_steps 5 -> 10 re-plans the schedule: "
        f"lr at step 30 goes from {cosine_w(30, 60, 5):.1e} to {cosine_w(30, 120, 10):.1e} "
        "(set optim.decay_steps=60, optim.warmup_steps=5 to keep the original schedule)")
    # In the warmup the lr is the same under both plans; the decay's new end is said.
    assert line(_config(60, warmup=4), _config(120, warmup=4), 2) == (
        f"jtrain: total_steps 60 -> 120 re-plans the schedule: lr at step 2 stays "
        f"{LR / 2:.1e}, the decay now ends at step 120, not 60 (set optim.decay_steps=60 "
        "to keep the original decay)")


def cosine_w(step, total, warmup):
    t = (step - warmup) / (total - warmup)
    return LR * ((1 - END) * 0.5 * (1 + math.cos(math.pi * t)) + END)
