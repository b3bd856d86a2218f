"""Preemption at any moment: SIGTERM during the CLI's start-up (before train() runs),
during a restore and during the first compile each end the run with exit 0 / a normal
return, with a checkpoint of the newest step if it has one and nothing else written.
(During an eval and during a save: tests/checkpoint/test_resume.py.)"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import jtrain
from jtrain.control import faults
from projects import mydata
from projects.linen_classifier import Net  # features -> 8 -> 2 classes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _data():  # 64 rows of 4 features, class 1 where the first is positive
    return mydata.make(64, train=None)


def _train(workdir):
    cfg = {"total_steps": 8, "optim": {"name": "sgd", "lr": 0.1, "schedule": "constant"},
           "data": {"batch_size": 8}, "eval": {"every_steps": 0},
           "log": {"writers": ("jsonl",), "verbosity": 0},
           "checkpoint": {"every_steps": 0},
           # step 1 compiles in the loop (not beside the state's init), so that a signal
           # 0.05 s into it arrives while it compiles
           "compile": {"precompile": False}}
    return jtrain.train(cfg, str(workdir), model=Net(), train_data=_data()).summary


@pytest.fixture
def fault(monkeypatch):
    def set_fault(spec):
        if spec:
            monkeypatch.setenv(faults.FAULT_ENV, spec)
        else:
            monkeypatch.delenv(faults.FAULT_ENV, raising=False)
    yield set_fault


def test_sigterm_during_restore_and_during_compile(tmp_path, fault):
    run = tmp_path / "run"
    fault("compile:1:TERM")  # arrives while step 1 compiles: step 1 finishes, is saved
    summary = _train(run)
    assert (summary["stopped_by"], summary["step"]) == ("SIGTERM", 1)
    assert os.listdir(run / "checkpoints") == ["1"]
    fault("restore:1:TERM")  # arrives while step 1 is restored: no step, nothing new
    summary = _train(run)
    assert (summary["stopped_by"], summary["step"], summary["resumed_from"]) == \
        ("SIGTERM", 1, 1)
    assert summary["message"] == ("jtrain: stopped by SIGTERM at step 1 during start-up; "
                                  "nothing new to save; rerun the same command to continue")
    assert os.listdir(run / "checkpoints") == ["1"]
    fault(None)
    summary = _train(run)
    assert (summary["stopped_by"], summary["step"], summary["resumed_from"]) == (None, 8, 1)


def test_cli_sigterm_during_startup_exits_0(tmp_path):
    """A scheduler's SIGTERM half a second after launch (the CLI is still importing):
    exit 0 with one line, not status 143, and no checkpoint."""
    shutil.copytree(os.path.join(REPO, "configs"), tmp_path / "configs",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", faults.FAULT_ENV)}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.Popen([sys.executable, "-m", "jtrain.main",
                             "--config=configs/base.py:debug", "--workdir=runs/x"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "jtrain: SIGTERM received during start-up: stopping before the first step" in err
    assert "Traceback" not in err
    ckpts = tmp_path / "runs" / "x" / "checkpoints"
    assert not ckpts.exists() or os.listdir(ckpts) == []
    with open(tmp_path / "runs" / "x" / "summary.json") as f:
        summary = json.load(f)
    assert summary["stopped_by"] == "SIGTERM" and summary["step"] == 0
    assert err.rstrip().splitlines()[-1] == summary["message"] == (
        "jtrain: stopped by SIGTERM at step 0 during start-up; nothing new to save; rerun "
        "the same command to continue")


def test_no_clean_stop_within_the_grace_period_exits_5(tmp_path):
    code = ("import os, signal, time\n"
            "from jtrain.control import Stopper\n"
            "with Stopper(grace_seconds=0.5):\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(60)  # a stop that never comes\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", faults.FAULT_ENV)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**env, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 5, proc.stderr[-2000:]
    assert proc.stderr.splitlines()[-1].startswith(
        "jtrain: hang error: no clean stop within the 0.5 s grace period")


def test_a_stop_that_jax_rewraps_inside_an_eval_is_still_a_stop():
    """SIGINT inside a jitted eval call: JAX's traceback filtering can fail on the
    interrupted frame and raise a TypeError in place of StopRequested (seen from an
    external os.kill in tests/journeys/test_journeys.py). The eval is still abandoned, no error."""
    from jtrain.control.signals import StopRequested, Stopper

    def eval_rewrapped_by_jax():
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except StopRequested:  # as JAX does: implicitly chained (__context__), no `from`
            raise TypeError(  # noqa: B904
                "'NoneType' object cannot be interpreted as an integer")

    def a_real_bug():
        raise TypeError("a bug in the eval")

    with Stopper(grace_seconds=600) as stopper:
        with pytest.raises(TypeError, match="a bug"):
            stopper.interruptible(a_real_bug)  # no signal: a bug stays a bug
        assert stopper.interruptible(eval_rewrapped_by_jax) == []
        assert stopper.signal_name == "SIGINT"
