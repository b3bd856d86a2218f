"""`best` wherever a step is chosen: `python -m jtrain.export RUN --step=best` and
`init.step=best` pick the same checkpoint as `jtrain.evaluate --step=best`
(the run's checkpoint.monitor as logged in metrics.jsonl), from relative paths; the rule
itself against known values: the lowest (mode min) or highest (mode max) logged value,
ties to the newer step, a step without a finite logged value never chosen."""

import json
import os
import shutil

import flax.linen as nn
import numpy as np
import pytest
from journey import run_python

import jtrain
from jtrain import evaluate
from jtrain import export as export_command
from jtrain.checkpoint import policy


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(2)(nn.relu(nn.Dense(8)(x)))


def _data():
    x = np.random.default_rng(0).normal(size=(96, 4)).astype(np.float32)
    return {"inputs": x, "targets": (x[:, 0] > 0).astype(np.int32)}


CFG = {"total_steps": 12, "data": {"batch_size": 8}, "log": {"verbosity": 0},
       "eval": {"every_steps": 2},  # a large lr: eval/loss goes up and down
       "optim": {"name": "sgd", "lr": 2.0, "schedule": "constant"},
       "checkpoint": {"every_steps": 2, "max_to_keep": 10}}


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A folder holding runs/a: one 12-step run with checkpoints at 2, 4, ..., 12,
    shared by this file's tests (each copies it before changing anything)."""
    home = tmp_path_factory.mktemp("best")
    jtrain.train(CFG, str(home / "runs" / "a"), model=Net(), train_data=_data())
    return home


def _write_metrics(workdir, values: dict, monitor="eval/loss"):
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        for step, value in values.items():
            f.write(json.dumps({"step": step, "train/loss": 1.0}) + "\n")
            f.write(json.dumps({"step": step, monitor: value}) + "\n")


def test_best_is_the_extreme_logged_value_and_a_tie_goes_to_the_newer_step(tmp_path):
    workdir = str(tmp_path)
    _write_metrics(workdir, {2: 0.5, 4: 0.3, 6: 0.9, 8: 0.3, 10: 0.9, 12: float("nan")})
    steps = [2, 4, 6, 8, 10, 12]
    assert policy.best_logged_step(workdir, steps, "eval/loss", "min") == 8   # 4 ties 8
    assert policy.best_logged_step(workdir, steps, "eval/loss", "max") == 10  # 6 ties 10
    assert policy.best_logged_step(workdir, [2, 4, 6], "eval/loss", "min") == 4
    assert policy.best_logged_step(workdir, [12], "eval/loss", "min") is None  # NaN
    assert policy.best_logged_step(workdir, steps, "eval/accuracy", "max") is None
    assert evaluate.resolve_step("best", steps, workdir) == 8  # default: eval/loss, min
    assert evaluate.resolve_step("best", steps, workdir, mode="max") == 10
    assert evaluate.resolve_step("latest", steps, workdir) == 12
    registry = {"2": 0.5, "4": 0.3, "6": 0.9, "8": 0.3, "10": 0.9}
    assert policy.best_steps(registry, steps, 3, "min") == [8, 4, 2]
    assert policy.best_steps(registry, steps, 2, "max") == [10, 6]


def test_export_and_init_from_best(home, monkeypatch):
    monkeypatch.chdir(home)
    steps = sorted(int(s) for s in os.listdir("runs/a/checkpoints"))
    assert steps == [2, 4, 6, 8, 10, 12]
    best = evaluate.resolve_step("best", steps, "runs/a")
    assert best != max(steps), "the test needs a best step that is not the last"
    proc = run_python(home, "-m", "jtrain.export", "runs/a", "--step=best",
                      "--out=exports/best")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.load(open("exports/best/export.json"))["step"] == best
    assert proc.stdout.startswith(f"jtrain: exported step {best}:")
    res = jtrain.train({**CFG, "total_steps": 1, "init": {
        "path": "runs/a", "step": "best"}}, "runs/ft", model=Net(),
        train_data=_data())
    assert res.summary["step"] == 1
    bad = export_command.main(["runs/a/checkpoints/2", "--step=best", "--out=exports/x"])
    assert bad == 3  # a step directory has no metrics.jsonl to rank by: one line, exit 3


@pytest.mark.parametrize("mode, expected", [("min", 4), ("max", 10)])
def test_export_best_follows_the_runs_checkpoint_mode(home, tmp_path, monkeypatch, mode,
                                                      expected):
    shutil.copytree(home / "runs" / "a", tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    _write_metrics("run", {2: 0.6, 4: 0.1, 6: 0.8, 8: 0.5, 10: 0.8, 12: 0.3})
    with open("run/config.json") as f:
        config = json.load(f)
    config["checkpoint"]["mode"] = mode
    with open("run/config.json", "w") as f:
        json.dump(config, f)
    assert export_command.main(["run", "--step=best", "--out=out"]) == 0
    assert json.load(open("out/export.json"))["step"] == expected
