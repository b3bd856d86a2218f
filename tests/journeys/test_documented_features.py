"""Documented features that had no test, each checked where a user meets it.

One plain-script run (`python run.py` in an empty directory, jtrain as installed) with
`checkpoint.keep_every_steps`, `JTRAIN_WRITER_NICE` and the MLflow and W&B writers
(offline W&B, MLflow's local sqlite store) is shared by the tests that read it. Then:
`checkpoint.grace_seconds` from a config, the precision policy's `auto` choices (the
platform is an argument of make_policy, so the GPU/TPU branches run here as logic),
`--distributed=auto` and the `JTRAIN_*` environment defaults of `python -m jtrain.main`."""

import json
import os
import sqlite3

import jax.numpy as jnp
import pytest
from absl import flags

from journey import copy_project, run_python
from jtrain import config as config_lib, main as main_lib, precision

SCRIPT = '''
import json
import os
import sys

import numpy as np

import jtrain
from linen_classifier import Net  # the user's own module


rng = np.random.default_rng(0)
x = rng.normal(size=(128, 4)).astype(np.float32)
y = (x[:, 0] > 0).astype(np.int32)
cfg = {"total_steps": 12, "data": {"batch_size": 16},
       "optim": {"name": "sgd", "lr": 0.1, "schedule": "constant"},
       "eval": {"every_steps": 6, "num_batches": 1},
       "log": {"every_steps": 3, "writers": ["jsonl", "mlflow", "wandb"]},
       "checkpoint": {"every_steps": 2, "max_to_keep": 1, "keep_every_steps": 4}}
result = jtrain.train(cfg, "runs/f", model=Net(), train_data={"inputs": x, "targets": y},
                      eval_data={"inputs": x[:32], "targets": y[:32]})
nices = []  # tensorstore's write threads, which JTRAIN_WRITER_NICE lowers
for tid in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{tid}/comm") as f:
        if f.read().startswith("ts_pool"):
            nices.append(os.getpriority(os.PRIO_PROCESS, int(tid)))
print(json.dumps({"summary": result.summary, "nices": nices}))
'''


@pytest.fixture(scope="module")
def feature_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("features")
    copy_project(cwd, "linen_classifier")
    (cwd / "run.py").write_text(SCRIPT)
    proc = run_python(cwd, "run.py", WANDB_MODE="offline", WANDB_SILENT="true",
                      JTRAIN_WRITER_NICE="7")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd, json.loads(proc.stdout.strip().splitlines()[-1])


def test_keep_every_steps_keeps_its_multiples_beside_the_latest(feature_run):
    cwd, out = feature_run
    assert out["summary"]["step"] == 12
    # saved every 2 steps, max_to_keep=1: only the latest (12) and multiples of 4 stay
    assert sorted(os.listdir(cwd / "runs" / "f" / "checkpoints"), key=int) == ["4", "8", "12"]


def test_writer_nice_lowers_the_background_write_threads(feature_run):
    _, out = feature_run
    assert out["nices"] and set(out["nices"]) == {7}, out["nices"]


def test_mlflow_records_the_real_run(feature_run):
    cwd, _ = feature_run
    db = cwd / "runs" / "f" / "mlflow.db"
    with sqlite3.connect(db) as con:
        losses = con.execute("SELECT step FROM metrics WHERE key = 'train/loss'").fetchall()
        evals = con.execute("SELECT step FROM metrics WHERE key = 'eval/loss'").fetchall()
        params = dict(con.execute("SELECT key, value FROM params").fetchall())
        status = con.execute("SELECT status FROM runs").fetchall()
    assert sorted(s for (s,) in losses) == [3, 6, 9, 12]
    assert sorted(s for (s,) in evals) == [6, 12]
    assert params["checkpoint.keep_every_steps"] == "4" and params["total_steps"] == "12"
    assert status == [("FINISHED",)]


def test_wandb_offline_records_the_real_run(feature_run):
    cwd, _ = feature_run
    runs = list((cwd / "runs" / "f" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    data = runs[0].read_bytes()
    assert b"train/loss" in data and b"eval/loss" in data and b"keep_every_steps" in data


GRACE = '''
import os
import signal
import time

import numpy as np
import torch

import jtrain


class Stalls(torch.utils.data.Dataset):
    """Asks for a stop (as a scheduler would) at item 41, then items 42-47 take 3 s
    each (none of them is among the items jtrain's data checks read first)."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == 41:
            os.kill(os.getpid(), signal.SIGTERM)
        if 41 < i < 48:
            time.sleep(3)
        return {"inputs": np.full(4, i, np.float32), "targets": np.int32(i % 10)}


cfg = {"total_steps": 100, "data": {"batch_size": 8, "shuffle": False},
       "model": {"name": "mlp"}, "eval": {"every_steps": 0},
       "checkpoint": {"every_steps": 0, "grace_seconds": 1.0},
       "log": {"writers": ["jsonl"]}}
jtrain.train(cfg, "runs/g", train_data=Stalls())
'''


def test_grace_seconds_from_the_config_bounds_the_stop(tmp_path):
    (tmp_path / "grace.py").write_text(GRACE)
    proc = run_python(tmp_path, "grace.py")
    assert proc.returncode == 5, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("jtrain: hang error: no clean stop within the 1 s grace period"), last


@pytest.mark.parametrize("platform,dtype,scale,want", [
    ("cpu", "auto", "auto", ("float32", False)),
    ("gpu", "auto", "auto", ("bfloat16", False)),
    ("tpu", "auto", "auto", ("bfloat16", False)),
    ("gpu", "float16", "auto", ("float16", True)),    # fp16 needs loss scaling: auto adds it
    ("gpu", "float16", "none", ("float16", False)),
    ("cpu", "float32", "dynamic", ("float32", True)),
])
def test_precision_auto_choices(platform, dtype, scale, want):
    cfg = config_lib.resolve({"model": {"dtype": dtype, "loss_scale": scale}})
    policy = precision.make_policy(cfg.model, platform=platform)
    assert (jnp.dtype(policy.compute_dtype).name, policy.dynamic_loss_scale) == want
    assert jnp.dtype(policy.param_dtype).name == "float32"


def test_jtrain_environment_gives_the_distributed_defaults(monkeypatch):
    monkeypatch.setenv("JTRAIN_COORDINATOR", "10.0.0.1:1234")
    monkeypatch.setenv("JTRAIN_NUM_PROCESSES", "4")
    monkeypatch.setenv("JTRAIN_PROCESS_ID", "3")
    fv = flags.FlagValues()
    main_lib.define_flags(fv)
    fv(["jtrain.main", "--config=cfg.py", "--workdir=w"])
    assert (fv.coordinator_address, fv.num_processes, fv.process_id) == ("10.0.0.1:1234", 4, 3)
    fv = flags.FlagValues()
    main_lib.define_flags(fv)
    fv(["jtrain.main", "--process_id=1"])  # a flag wins over the environment
    assert fv.process_id == 1


def test_distributed_auto_outside_a_cluster_is_one_line(tmp_path):
    (tmp_path / "cfg.py").write_text("from jtrain.config import defaults\n\n\n"
                                     "def get_config():\n    return defaults(model='mlp')\n")
    proc = run_python(tmp_path, "-m", "jtrain.main", "--config=cfg.py", "--workdir=runs/d",
                      "--distributed=auto")
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--distributed=auto" in lines[0], proc.stderr[-3000:]
    assert not (tmp_path / "runs").exists()
