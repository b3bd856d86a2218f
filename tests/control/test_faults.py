"""debug.faults (jtrain/control/faults.py): the syntax and its one-line errors; a NaN that
halts, a NaN that is skipped and a failed writer, each firing once across the restarts
(in-process); and the user's journey of docs/guide/run-control.md: a run killed three
times by its own faults (a kill, a torn checkpoint write, a kill) and restarted by a
loop ends bitwise identical to a run never killed, its goodput ledger counts the four
sessions, the recomputed steps and the restart gaps, and `jtrain evaluate` draws it in
goodput.png (the reference run and the evaluate run in this process: the restart loop is
the journey)."""

import json
import re
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

import jtrain
import jtrain.evaluate
from journey import nnx_mlp_config, run_python, marked_block, user_dir
from jtrain import errors
from jtrain import main as main_lib
from jtrain.config import rules
from jtrain.control import faults
from jtrain.observe import goodput

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "guide" / "run-control.md"


@pytest.mark.parametrize("spec, why", [
    ("boom@3", "unknown kind 'boom'; kinds: kill, hang, slow, nan, torn_ckpt, writer_fail, "
     "lost_local"),
    ("kill", "expected a step number after '@'"),
    ("kill@x", "expected a step number after '@'"),
    ("kill@0", "steps start at 1"),
    ("kill@3-5", "kill takes one step, not a range"),
    ("slow@5-3:1s", "a range goes up"),
    ("slow@5", "a slow fault needs its seconds per step"),
    ("kill@3:2s", "kill takes no seconds"),
    ("nan@3:p1", "nan takes no process: the loss is the same on every process"),
    ("torn_ckpt@4:p1", "torn_ckpt takes no process: process 0 does it"),
    ("hang@3:q", "cannot read 'q'"),
    ("kill@3,kill@3", "'kill@3' is given twice"),
    ("kill@50", "step 50 is after total_steps=40; it would never fire"),
    ("lost_local@3", "deletes the local checkpoint tier: set checkpoint.local_dir"),
])
def test_a_malformed_fault_is_one_line_naming_the_key(spec, why):
    with pytest.raises(jtrain.ConfigError) as e:
        jtrain.resolve({"model": {"name": "mlp"}, "total_steps": 40,
                        "debug": {"faults": spec}})
    line = errors.render(e.value)
    assert line.startswith("jtrain: config error: debug.faults: '") and why in line, line
    assert "\n" not in line and errors.exit_code(e.value) == 2


def test_the_syntax_reads_steps_processes_and_seconds():
    got = rules.parse_faults(" kill@7, nan@12,hang@20:p1 ,slow@5-9:p0:0.2s,torn_ckpt@10,"
                             "writer_fail@15,hang@3:1.5s", total_steps=20)
    assert [(f.kind, f.first, f.last, f.process, f.seconds) for f in got] == [
        ("kill", 7, 7, None, None), ("nan", 12, 12, None, None), ("hang", 20, 20, 1, None),
        ("slow", 5, 9, 0, 0.2), ("torn_ckpt", 10, 10, None, None),
        ("writer_fail", 15, 15, None, None), ("hang", 3, 3, None, 1.5)]
    assert got[3].text == "slow@5-9:p0:0.2s" and rules.parse_faults("") == []


def test_a_hang_for_good_needs_the_watchdog():
    cfg = jtrain.resolve({"model": {"name": "mlp"}, "debug": {"faults": "hang@3"}})
    with pytest.raises(jtrain.ConfigError, match=r"debug.faults: 'hang@3' stops the process "
                       r"for good and the watchdog is off: set watchdog.timeout_s > 0"):
        faults.arm_plan(cfg, None, 0, 1)
    faults.arm_plan(cfg, None, 0, 2)  # several processes: the watchdog's 1800 s default
    cfg.watchdog.timeout_s = 5.0
    faults.arm_plan(cfg, None, 0, 1)
    faults.arm_plan(jtrain.resolve({"model": {"name": "mlp"}}), None)  # disarmed again


def test_step_faults_fire_by_step_and_process_once_per_workdir(tmp_path, monkeypatch):
    """slow, hang and kill at their global steps on their processes (sleeps and signals
    recorded, not made); armed again from the same workdir, none fires twice."""
    cfg = jtrain.resolve({"model": {"name": "mlp"}, "total_steps": 10, "debug": {
        "faults": "slow@2-3:p0:0.5s,hang@4:2s,kill@5:p1,kill@6"}})
    acted = []
    monkeypatch.setattr(faults.time, "sleep", lambda s: acted.append(("sleep", s)))
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: acted.append(("kill", sig)))

    def steps(process):
        faults.arm_plan(cfg, str(tmp_path), process, 2)
        done = []
        for step in range(1, 8):
            acted.clear()
            faults.fault_point("step", step=step)
            done += [(step, *a) for a in acted]
        return done

    try:
        assert steps(0) == [(2, "sleep", 0.5), (3, "sleep", 0.5), (4, "sleep", 2.0),
                            (6, "kill", faults.signal.SIGKILL)]
        assert steps(1) == [(4, "sleep", 2.0), (5, "kill", faults.signal.SIGKILL),
                            (6, "kill", faults.signal.SIGKILL)]
        assert steps(0) == steps(1) == []  # every one fired already in this workdir
    finally:
        faults.arm_plan(jtrain.resolve({"model": {"name": "mlp"}}), None)
    fired = [json.loads(x) for x in (tmp_path / faults.FILE).read_text().splitlines()]
    assert [(f["fault"], f["process"], f["step"]) for f in fired] == [
        ("slow@2-3:p0:0.5s", 0, 2), ("hang@4:2s", 0, 4), ("kill@6", 0, 6),
        ("hang@4:2s", 1, 4), ("kill@5:p1", 1, 5), ("kill@6", 1, 6)]


def _train(workdir, policy: str):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(192, 8)).astype(np.float32)
    y = (x[:, :4].sum(1) > x[:, 4:].sum(1)).astype(np.int32)
    cfg = {"seed": 0, "total_steps": 12, "model": {"name": "mlp", "hidden": (8,),
                                                    "num_outputs": 2},
           "data": {"batch_size": 16}, "optim": {"lr": 1e-2, "warmup_steps": 1},
           "eval": {"every_steps": 4, "num_batches": 1},
           "checkpoint": {"every_steps": 4, "async_save": False},
           "log": {"every_steps": 2, "writers": ("jsonl",)}, "nonfinite": {"policy": policy},
           "debug": {"faults": "nan@3,nan@5,writer_fail@7"}}
    return jtrain.train(cfg, str(workdir), train_data=(x[:160], y[:160]),
                        eval_data=(x[160:], y[160:]))


@pytest.mark.slow  # seconds of CPU: the full suite runs it (tests/README.md)
def test_nan_halts_or_is_skipped_a_writer_fails_and_each_fires_once(tmp_path):
    """nan@3 under nonfinite.policy=halt: exit 4 at step 3. The same workdir with
    policy=skip (resume-safe): nan@3 is spent, nan@5 is skipped (skip ledger), the writer
    fails from step 7 (exit 1, before the save of step 8). Again: every fault is spent,
    the run resumes from step 4 and ends with no skipped step."""
    workdir = tmp_path / "run"
    with pytest.raises(errors.NonFiniteError) as halted:
        _train(workdir, "halt")
    assert errors.exit_code(halted.value) == 4 and "step 3" in errors.render(halted.value)
    with pytest.raises(RuntimeError) as broken:
        _train(workdir, "skip")
    line = errors.render(broken.value)
    assert line == ("jtrain: internal error: metric writer 'jsonl' failed: OSError: [Errno 5] "
                    "injected writer failure (debug.faults writer_fail@7)"), line
    assert errors.exit_code(broken.value) == 1
    skipped = [json.loads(x) for x in (workdir / "skipped.jsonl").read_text().splitlines()]
    assert [(s["step"], s["reason"]) for s in skipped] == [(5, "non-finite loss")]
    done = _train(workdir, "skip").summary
    assert done["step"] == 12 and done["resumed_from"] == 4 and done["skipped_steps"] == 0
    fired = [json.loads(x) for x in (workdir / faults.FILE).read_text().splitlines()]
    assert [(f["fault"], f["step"], f["process"]) for f in fired] == [
        ("nan@3", 3, 0), ("nan@5", 5, 0), ("writer_fail@7", 7, 0)]


CONFIG = nnx_mlp_config(total_steps=12, eval_every=4, log_every=2, checkpoint_every=4)


def guide_script() -> str:
    """The restart loop of the guide's fault section, as a user copies it."""
    return marked_block(GUIDE, "tests/control/test_faults.py")


@pytest.fixture(scope="module")
def chaos(tmp_path_factory):
    """(cwd, the restart loop's process). The reference, a run never killed, is the same
    command without faults, run in this process (the journey is the loop)."""
    cwd = user_dir(tmp_path_factory.mktemp("faults"), ["nnx_mlp"],
                   {"cfg.py": CONFIG, "restart.py": guide_script()})
    loop = run_python(cwd, "restart.py", timeout=600)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        mp.syspath_prepend(str(cwd))  # as `python -m` puts the cwd on sys.path
        main_lib.cli(["jtrain", "--config=cfg.py", "--config.checkpoint.async_save=false",
                      "--workdir=runs/ref"])
    sys.modules.pop("nnx_mlp", None)
    return cwd, loop


def test_three_injected_kills_end_bitwise_and_the_ledger_counts_them(chaos):
    cwd, loop = chaos
    assert loop.returncode == 0, loop.stderr[-3000:]
    said = [ln for ln in loop.stdout.splitlines() if ln.startswith("attempt ")]
    assert said == ["attempt 1: exit -9", "attempt 2: exit -9",
                                        "attempt 3: exit -9", "attempt 4: exit 0"]
    # The torn write of step 8 was never taken: removed, the restart resumed from 4.
    assert re.search(r"warning: \S*runs/chaos/checkpoints/8\.orbax-checkpoint-tmp\S*: an "
                     r"unfinished save \(killed while writing\); removed", loop.stderr)
    run, ref = cwd / "runs" / "chaos", cwd / "runs" / "ref"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["state_sha256"] == json.loads((ref / "summary.json").read_text())[
        "state_sha256"]
    assert (run / "hashes.jsonl").read_text() == (ref / "hashes.jsonl").read_text()
    assert len((run / "hashes.jsonl").read_text().splitlines()) == 12
    fired = [json.loads(x)["fault"] for x in (run / faults.FILE).read_text().splitlines()]
    assert fired == ["kill@6", "torn_ckpt@8", "kill@10"]
    records = goodput.read(str(run))
    assert [(r["first_step"], r["step"], r["done"]) for r in records] == [
        (0, 6, False), (4, 8, False), (4, 10, False), (8, 12, True)]
    block = summary["goodput"]
    assert block["sessions"] == 4
    # Steps 5-6, 5-8 and 9-10 were computed again: the restarts resumed from 4, 4 and 8.
    assert block["steps"] == {"computed": 20, "recomputed": 8}
    s = block["seconds"]
    assert sum(s.values()) == pytest.approx(block["total_sec"], abs=0.01)
    assert block["total_sec"] == pytest.approx(records[-1]["end"] - records[0]["start"],
                                               abs=2e-3)
    assert s["recomputed"] > 0 and s["productive"] > 0 and all(v >= 0 for v in s.values())
    gaps = [b["start"] - a["end"] for a, b in zip(records, records[1:], strict=False)]
    assert min(gaps) > 0 and s["restart_gaps"] == pytest.approx(sum(gaps), abs=2e-3)


def png_text(path: Path) -> dict[str, str]:
    """The PNG's text chunks, its signature and chunk CRCs checked."""
    import zlib

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    out, at = {}, 8
    while at < len(data):
        size, kind = struct.unpack(">I4s", data[at:at + 8])
        body = data[at + 8:at + 8 + size]
        assert struct.unpack(">I", data[at + 8 + size:at + 12 + size])[0] == \
            zlib.crc32(kind + body)
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            out[key.decode("latin-1")] = value.decode("latin-1")
        at += 12 + size
    assert kind == b"IEND"
    return out


def test_evaluate_draws_the_sessions_from_goodput_jsonl(chaos, monkeypatch):
    cwd, _ = chaos
    monkeypatch.chdir(cwd)  # `jtrain evaluate --workdir=runs/chaos --num_batches=1`, in-process
    monkeypatch.syspath_prepend(str(cwd))
    try:
        assert jtrain.evaluate.main(["--workdir=runs/chaos", "--num_batches=1"]) == 0
    finally:
        sys.modules.pop("nnx_mlp", None)
    run = cwd / "runs" / "chaos"
    assert "goodput.png" in json.loads((run / "eval_12.json").read_text())["files"]
    png = run / "goodput.png"
    assert png.stat().st_size > 0
    drawn = json.loads(png_text(png)["goodput"])["sessions"]
    rows = goodput.sessions(goodput.read(str(run)))
    assert len(drawn) == 4
    for bar, row in zip(drawn, rows, strict=True):
        assert bar == pytest.approx({k: round(v, 6) for k, v in row["seconds"].items()},
                                    abs=1e-6)
    assert drawn[0]["restart_gaps"] == 0 and min(b["restart_gaps"] for b in drawn[1:]) > 0
    assert sum(b["recomputed"] for b in drawn) > 0
    block = json.loads((run / "summary.json").read_text())["goodput"]
    assert sum(map(sum, (b.values() for b in drawn))) == pytest.approx(
        block["total_sec"], abs=0.01)
