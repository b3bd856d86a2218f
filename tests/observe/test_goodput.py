"""The goodput ledger (jtrain/observe/goodput.py) on real in-process runs: one session's
categories add up to its wall time, measured outside; a run that crashed, was stopped by
SIGTERM and resumed accounts for its three sessions, its recomputed steps exactly (those
after the checkpoint the next session resumed from) and its restart gaps."""

import json
import time

import numpy as np
import pytest

import jtrain
from jtrain.control import faults
from jtrain.engine import loop as loop_lib
from jtrain.observe import goodput

TOTAL = 40
NAMED = ("productive", "startup", "compile", "checkpoints", "eval", "data", "recomputed",
         "restart_gaps")


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(320, 8)).astype(np.float32)
    y = (x[:, :4].sum(1) > x[:, 4:].sum(1)).astype(np.int32)
    return (x[:256], y[:256]), (x[256:], y[256:])


def train(workdir, total=TOTAL):
    cfg = {"seed": 0, "total_steps": total,
           "model": {"name": "mlp", "hidden": (16,), "num_outputs": 2},
           "data": {"batch_size": 16}, "optim": {"lr": 1e-2, "warmup_steps": 2,
                                                 "decay_steps": TOTAL},
           "eval": {"every_steps": 10, "num_batches": 2}, "checkpoint": {"every_steps": 10},
           "log": {"every_steps": 10, "writers": ("jsonl",)}}
    train_data, eval_data = data()
    return jtrain.train(cfg, str(workdir), train_data=train_data, eval_data=eval_data)


def check_sums(block, t0, t1):
    """Every second between the first session's start and the last one's end is in one
    category; that span lies inside what the test measured around the calls (the first
    session in a process also counts the imports before it)."""
    s = block["seconds"]
    assert all(v >= 0 for k, v in s.items() if k != "other"), s
    assert block["total_sec"] == pytest.approx(sum(s.values()), rel=1e-3, abs=0.005)
    assert abs(s["other"]) <= 0.05 * block["total_sec"], s  # only the summary's own time
    assert t0 - block["startup_phases"].get("imports", 0.0) - 0.01 <= block["start"]
    assert block["end"] <= t1
    assert block["fraction"] == pytest.approx(s["productive"] / block["total_sec"], abs=1e-3)
    assert s["productive"] > 0 and s["startup"] > 0 and s["eval"] > 0 and s["checkpoints"] > 0


def test_one_session_adds_up(tmp_path):
    t0 = time.time()
    summary = train(tmp_path / "run", total=20).summary
    t1 = time.time()
    block = summary["goodput"]
    check_sums(block, t0, t1)
    assert block["sessions"] == 1 and block["steps"] == {"computed": 20, "recomputed": 0}
    assert block["seconds"]["recomputed"] == 0 and block["seconds"]["restart_gaps"] == 0
    lines = (tmp_path / "run" / goodput.FILE).read_bytes().split(b"\n")[:-1]
    assert [len(x) + 1 for x in lines] == [goodput.WIDTH]
    record = json.loads(lines[0])
    assert record["done"] and record["step"] == 20 and [s for s, _ in record["saves"]] == [10, 20]


class Crash(Exception):
    pass


def test_crash_term_resume_accounts_every_session(tmp_path, monkeypatch):
    """Session 1 crashes right after dispatching step 15 (checkpoint 10: steps 11-15 are
    recomputed), session 2 resumes at 10 and is stopped by SIGTERM after 15 more steps (step
    25, saved), session 3 finishes; a fourth call finds it finished and leaves the ledger."""
    workdir = tmp_path / "run"
    t0 = time.time()

    def crash_at_15(step, state):
        if step == 15:
            raise Crash
        return state

    with monkeypatch.context() as m:
        m.setattr(loop_lib, "perturb", crash_at_15)
        with pytest.raises(Crash):
            train(workdir)
    time.sleep(0.3)  # the restart gap
    with monkeypatch.context() as m:
        m.setattr(faults, "_fault_counts", {})
        m.setenv(faults.FAULT_ENV, "step:15:TERM")
        stopped = train(workdir).summary
    assert stopped["stopped_by"] == "SIGTERM" and stopped["step"] == 25
    assert stopped["goodput"]["sessions"] == 2
    assert stopped["goodput"]["steps"] == {"computed": 30, "recomputed": 5}
    done = train(workdir).summary
    t1 = time.time()
    block = done["goodput"]
    check_sums(block, t0, t1)
    assert block["sessions"] == 3
    assert block["steps"] == {"computed": 45, "recomputed": 5}  # 15 + 15 + 15; 11-15 twice
    s = block["seconds"]
    assert s["restart_gaps"] >= 0.3 and s["recomputed"] > 0
    records = [json.loads(x) for x in (workdir / goodput.FILE).read_bytes().split(b"\n")[:-1]]
    assert [(r["first_step"], r["step"], r["done"]) for r in records] == [
        (0, 15, False), (10, 25, True), (25, 40, True)]
    # The crashed session's steps 11-15: its step seconds after its save at step 10.
    first = records[0]
    assert s["recomputed"] == pytest.approx(first["steps"] - dict(first["saves"])[10], abs=2e-3)
    again = train(workdir).summary
    assert again["goodput"] == block  # the stored summary; the ledger is unchanged
    assert len((workdir / goodput.FILE).read_bytes()) == 3 * goodput.WIDTH
    assert goodput.line(block).startswith(
        f"jtrain: goodput {100 * block['fraction']:.1f}% of ")
