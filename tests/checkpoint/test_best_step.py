"""`best` wherever a step is chosen: `python -m jtrain.export RUN --step=best` and
`checkpoint.init_from_step=best` pick the same checkpoint as `jtrain.evaluate --step=best`
(the run's checkpoint.monitor as logged in metrics.jsonl), from relative paths."""

import json
import os
import subprocess
import sys

import flax.linen as nn
import numpy as np

import jtrain
from jtrain import evaluate
from jtrain.checkpoint import export
from jtrain import export as export_command


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(2)(nn.relu(nn.Dense(8)(x)))


def _data():
    x = np.random.default_rng(0).normal(size=(96, 4)).astype(np.float32)
    return {"inputs": x, "targets": (x[:, 0] > 0).astype(np.int32)}


def test_export_and_init_from_best(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = {"total_steps": 12, "data": {"batch_size": 8}, "log": {"verbosity": 0},
           "eval": {"every_steps": 2},  # a large lr: eval/loss goes up and down
           "optim": {"name": "sgd", "lr": 2.0, "schedule": "constant"},
           "checkpoint": {"every_steps": 2, "max_to_keep": 10}}
    jtrain.train(cfg, "runs/a", model=Net(), train_data=_data())
    steps = sorted(int(s) for s in os.listdir("runs/a/checkpoints"))
    best = evaluate.resolve_step("best", steps, "runs/a")
    assert best != max(steps), "the test needs a best step that is not the last"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    proc = subprocess.run([sys.executable, "-m", "jtrain.export", "runs/a", "--step=best",
                           "--out=exports/best"], capture_output=True, text=True,
                          timeout=300, env={**env, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.load(open("exports/best/export.json"))["step"] == best
    assert proc.stdout.startswith(f"jtrain: exported step {best}:")
    res = jtrain.train({**cfg, "total_steps": 1, "checkpoint": {
        "init_from": "runs/a", "init_from_step": "best"}}, "runs/ft", model=Net(),
        train_data=_data())
    assert res.summary["step"] == 1
    bad = export_command.main(["runs/a/checkpoints/2", "--step=best", "--out=exports/x"])
    assert bad == 3  # a step directory has no metrics.jsonl to rank by: one line, exit 3
