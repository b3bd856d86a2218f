"""A run directory is data from someone else: hostile files planted in one small trained
run (a FIFO, a symlink, a list where an object belongs, a malformed ledger record) are
each one line naming the file and a non-zero exit, promptly; nothing is written through a
link; a malformed goodput record never fails a run that trained. jtrain evaluate runs
in-process (`cli.main`, the command's own error path), once as a person runs it."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading

import pytest

import jtrain
from jtrain import cli, errors
from jtrain import evaluate as evaluate_lib
from jtrain.config.rules import parse_faults
from jtrain.control import faults
from jtrain.engine import async_eval
from jtrain.errors import ConfigError, WorkdirError
from jtrain.observe import goodput, layout, trust
from journey import copy_project, run_python

CFG = {"model": {"name": "user", "factory": "mymodels:make", "kwargs": {"hidden": 4}},
       "data": {"source": "mydata:make", "batch_size": 16}, "total_steps": 2,
       "eval": {"every_steps": 0}, "checkpoint": {"every_steps": 2},
       "log": {"verbosity": 0, "writers": ["jsonl"]}}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One small run trained in-process, signed with the suite's key."""
    root = tmp_path_factory.mktemp("hostile")
    copy_project(root, "mymodels", "mydata")
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(root))
    mp.chdir(root)
    try:
        jtrain.train(CFG, "runs/a")
    finally:
        mp.undo()
    return root


@pytest.fixture
def run(trained, tmp_path, monkeypatch):
    """A copy of the trained run as runs/x under the test's cwd."""
    shutil.copytree(trained / "runs/a", tmp_path / "runs/x")
    copy_project(tmp_path, "mymodels", "mydata")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "runs/x"


def _fifo(path) -> threading.Event:
    """A FIFO at `path`. Should a reader block on it, after 30 s a writer opens and
    closes it every 0.2 s, so the test fails on what the readers then return instead of
    hanging; set the returned event to call the writer off."""
    if os.path.lexists(path):
        os.unlink(path)
    os.mkfifo(path)
    done = threading.Event()

    def unblock():
        done.wait(30)
        while not done.wait(0.2):
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass  # no reader blocked on it now

    threading.Thread(target=unblock, daemon=True).start()
    return done


def _one_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and "Traceback" not in "\n".join(lines), lines
    return lines[-1]


def test_fifo_goodput_is_one_line_before_the_eval(run, capsys):
    done = _fifo(run / goodput.FILE)
    try:
        assert cli.main(["evaluate", "--workdir=runs/x"]) == 2
    finally:
        done.set()
    assert _one_line(capsys) == (
        f"jtrain: workdir error: {run / goodput.FILE}: not a regular file (a FIFO, a device "
        "or a folder); jtrain reads only regular files in a run")
    assert not list(run.glob("eval_*"))  # refused before the eval wrote anything


def test_fifo_faults_and_eval_result_are_one_line(run):
    cfg = jtrain.resolve({**CFG, "debug": {"faults": "slow@3:0.01s"}, "total_steps": 4})
    done = _fifo(run / faults.FILE)
    try:
        with pytest.raises(WorkdirError, match=f"{run / faults.FILE}: not a regular file"):
            faults.arm_plan(cfg, str(run), 0, 1)  # at start-up, before step 1
    finally:
        done.set()
        faults.arm_plan(jtrain.resolve({"model": {"name": "mlp"}}), None)
    os.makedirs(run / layout.EVALS)
    done = _fifo(layout.eval_result_path(str(run), 2))
    try:
        with pytest.raises(WorkdirError, match=r"evals/2.json: not a regular file"):
            layout.read_eval_result(str(run), 2)
    finally:
        done.set()


def test_summary_list_under_follow_and_export_best_config_list(run, capsys):
    (run / "summary.json").write_text("[]")
    with pytest.raises(WorkdirError) as raised:
        async_eval._finished(str(run), [2])
    assert errors.render(raised.value) == (
        f"jtrain: workdir error: {run / 'summary.json'}: not a JSON object (a list)")
    (run / "config.json").write_text("[]")
    assert cli.main(["export", "--workdir=runs/x", "--step=best", "--out=out"]) == 3
    assert _one_line(capsys) == (
        "jtrain: export error: runs/x/config.json: not a JSON object (a list)")
    assert not os.path.exists("out")
    (run / "config.json").write_text('{"checkpoint": {"monitor": 3}}')
    assert cli.main(["export", "--workdir=runs/x", "--step=best", "--out=out"]) == 3
    assert _one_line(capsys).endswith(
        "config.json: checkpoint.monitor: expected a string, got 3")


def test_signature_not_ascii_is_refused_in_one_line(run):
    config = json.loads((run / "config.json").read_text())
    assert trust.verify(str(run))  # the suite's key signed it
    (run / trust.SIGNATURE_FILE).write_text("é" * 64 + "\n")
    assert not trust.verify(str(run))
    with pytest.raises(WorkdirError) as raised:
        trust.check(str(run), config, shown="runs/x")
    assert errors.render(raised.value).startswith(
        "jtrain: workdir error: runs/x/config.json: names code that runs when it is opened")


@pytest.mark.parametrize("text", ["kill@²", "kill@3-²", "slow@3:p²:0.1s", "kill@٣"])
def test_fault_steps_are_ascii_digits(text):
    with pytest.raises(ConfigError) as raised:
        parse_faults(text, 10)
    assert errors.render(raised.value).startswith(f"jtrain: config error: debug.faults: "
                                                  f"{text!r}: ")


def test_written_through_no_planted_link(run, tmp_path):
    """evaluate's PNGs replace links planted at their paths; a run whose checkpoints/ or
    tb/ folder is a link is refused at start-up, before anything is written."""
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in ("eval_2_curves.png", "goodput.png"):
        (outside / name).write_bytes(b"precious")
        os.symlink(outside / name, run / name)
    assert cli.main(["evaluate", "--workdir=runs/x"]) == 0
    for name in ("eval_2_curves.png", "goodput.png"):
        assert (outside / name).read_bytes() == b"precious"
        assert not (run / name).is_symlink()
        assert (run / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    for folder in ("tb", "checkpoints", "evals"):
        target = outside / folder
        if (run / folder).exists():
            shutil.move(run / folder, target)
        else:
            target.mkdir()
        os.symlink(target, run / folder)
        with pytest.raises(WorkdirError) as raised:
            if folder == "evals":
                evaluate_lib.evaluate_checkpoint("runs/x", plots=False)
            else:
                jtrain.train({**CFG, "total_steps": 4}, "runs/x",
                             allow_changes=["total_steps"])
        line = errors.render(raised.value)
        assert line.startswith("jtrain: workdir error: ") and (
            f"runs/x/{folder}: is a symlink; jtrain writes only inside the run") in line, line
        os.unlink(run / folder)
        shutil.move(target, run / folder)
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_malformed_goodput_record_never_fails_a_run_that_trained(run, caplog):
    """A session line of another shape planted in goodput.jsonl: the resumed run trains,
    skips it with a warning, and sums the two real sessions."""
    ledger = run / goodput.FILE
    first = ledger.read_bytes()
    assert len(first) == goodput.WIDTH
    bad = json.dumps({"start": 1.0, "steps": "many", "phases": []}).encode()
    ledger.write_bytes(first + bad.ljust(goodput.WIDTH - 1) + b"\n")
    with caplog.at_level(logging.WARNING):
        result = jtrain.train({**CFG, "total_steps": 4}, "runs/x",
                              allow_changes=["total_steps"])
    assert result.summary["step"] == 4 and result.summary["goodput"]["sessions"] == 2
    assert f"{ledger}: line 2: step: missing; skipped" in caplog.text
    records = goodput.read(str(run))  # the planted line stays; the new session after it
    assert [r["first_step"] for r in records] == [0, 2]


def test_goodput_summary_is_linear_in_the_sessions():
    """sessions() reads each record's first_step a bounded number of times (a slice of
    the later sessions per session read it n^2 / 2 times), and its recomputed steps
    equal a direct count: the steps a session computed beyond the least first step of
    the sessions after it."""
    reads = [0]

    class Counted(dict):
        def __getitem__(self, key):
            reads[0] += key == "first_step"
            return dict.__getitem__(self, key)

    n, records, at = 600, [], 0.0
    for i in range(n):
        first = (i * 7) % 50
        records.append(Counted({"step": first + 10, "first_step": first, "start": at,
                                "end": at + 1.0, "steps": 10.0, "saves": [],
                                "phases": {}, **{c: 0.0 for c in goodput.CATEGORIES
                                                 if c != "steps"}}))
        at += 2.0
    rows = goodput.sessions(records)
    assert reads[0] <= 6 * n, reads[0]
    for i, (r, row) in enumerate(zip(records, rows, strict=True)):
        later = [dict.__getitem__(q, "first_step") for q in records[i + 1:]]
        expect = max(0, r["step"] - max(min(later), r["first_step"])) if later else 0
        assert row["recomputed"] == expect, i
    assert goodput.block(records)["sessions"] == n


def test_evaluate_on_a_hostile_run_as_a_person_runs_it(run):
    """`python -m jtrain evaluate` with a FIFO as goodput.jsonl: exit 2, one line on
    stderr naming the file, promptly, no traceback."""
    done = _fifo(run / goodput.FILE)
    try:
        got = run_python(run.parent.parent, "-m", "jtrain", "evaluate", "--workdir=runs/x",
                         timeout=120)
    finally:
        done.set()
    assert got.returncode == 2, got.stderr
    lines = got.stderr.strip().splitlines()
    assert lines == [f"jtrain: workdir error: {os.path.abspath('runs/x/goodput.jsonl')}: "
                     "not a regular file (a FIFO, a device or a folder); jtrain reads only "
                     "regular files in a run"], lines
