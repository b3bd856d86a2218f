"""Hyperparameter search as a user runs it: `python -m jtrain.tune` in a subprocess from a
temp cwd holding their NNX model, data and config modules, relative paths, no test
helpers. One search, its tuner SIGKILLed mid-trial and rerun, feeds two tests: it prunes
and its best_config.py retrains to the best trial's state_sha256; the rerun ends with the
trial count and the killed trial continues from its own checkpoint. Two tuners on one
SQLite study; a trial of two processes."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from journey import copy_project, run_python, user_env

CONFIG = '''
from jtrain.config import defaults

def get_config():
    config = defaults(model="user")
    config.update({
        "model": {"factory": "mymodels:make"},
        "data": {"source": "mydata:make", "batch_size": 16},
        "total_steps": 8,
        "eval": {"every_steps": 2, "metrics": ("loss",)},
        "checkpoint": {"every_steps": 4},
        "log": {"every_steps": 4, "writers": ("jsonl",)},
        "tune": {"space": {"optim": {"lr": ("log_uniform", 1e-3, 3e-1),
                                     "weight_decay": ("uniform", 0.0, 0.1)},
                           "data": {"batch_size": ("choice", (16, 32))}},
                 "trials": 6, "prune_startup_trials": 2},
    })
    return config
'''


def _user_dir(tmp_path):
    copy_project(tmp_path, "mymodels", "mydata")
    (tmp_path / "search.py").write_text(CONFIG)
    return tmp_path


def _records(path):
    return [json.loads(line) for line in open(path)]


def _sha(workdir):
    with open(os.path.join(workdir, "summary.json")) as f:
        return json.load(f)["state_sha256"]


@pytest.fixture(scope="module")
def search(tmp_path_factory):
    """One search, as its user meets it: the tuner SIGKILLed mid-trial (after trial 0's
    step 7, its checkpoint of step 4 written), then the same command run again to the
    end. (cwd, the rerun's process)."""
    cwd = _user_dir(tmp_path_factory.mktemp("search"))
    args = ["-m", "jtrain.tune", "--config=search.py", "--workdir=runs/s"]
    killed = run_python(cwd, *args, JTRAIN_FAULT="step:7")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert (cwd / "runs/s/trials/0/checkpoints/4").is_dir()
    assert not (cwd / "runs/s/trials.jsonl").exists()  # killed before the end
    r = run_python(cwd, *args)
    assert r.returncode == 0, r.stderr[-2000:]
    return cwd, r


def test_search_prunes_and_best_config_retrains_bitwise(search):
    cwd, r = search
    recs = _records(cwd / "runs/s/trials.jsonl")
    assert [x["number"] for x in recs] == list(range(7))  # 6 trials, one continued
    states = [x["state"] for x in recs]
    assert states[0] == "interrupted", states
    assert set(states[1:]) <= {"complete", "pruned"} and "pruned" in states, states
    for x in recs[1:]:
        assert x["step"] == 8 if x["state"] == "complete" else x["step"] < 8, x
        assert set(x["params"]) == {"optim.lr", "optim.weight_decay", "data.batch_size"}
    for name in ("best_config.py", "tune.png", "study.db"):
        assert (cwd / "runs/s" / name).exists(), name
    done = [x for x in recs if x["state"] == "complete"]
    best = min(done, key=lambda x: x["value"])
    assert f"best trial {best['number']}: eval/loss=" in r.stdout

    # Retrain on the best config from the CLI: the same final state, bit for bit.
    r = run_python(cwd, "-m", "jtrain.main", "--config=runs/s/best_config.py",
                   "--workdir=runs/best")
    assert r.returncode == 0, r.stderr[-2000:]
    assert _sha(cwd / "runs/best") == _sha(cwd / "runs/s" / best["workdir"])


def test_killed_tuner_reruns_to_the_trial_count_resuming_the_killed_trial(search):
    cwd, r = search
    recs = _records(cwd / "runs/s/trials.jsonl")
    assert [x["state"] for x in recs].count("interrupted") == 1
    assert len([x for x in recs if x["state"] != "interrupted"]) == 6  # tune.trials
    killed, cont = recs[:2]
    assert "interrupted" in killed["reason"] and killed["workdir"] == "trials/0"
    assert killed["step"] is None or killed["step"] < 8, killed
    assert cont["continues"] == 0 and cont["workdir"] == "trials/0"
    assert cont["params"] == killed["params"] and cont["step"] == 8
    assert cont["state"] == "complete"
    assert all(x["workdir"] == f"trials/{x['number']}" for x in recs[2:])
    assert all(x["params"] != killed["params"] for x in recs[2:])
    assert cont["resumed_from"] == 4, cont  # its checkpoint, not step 0
    log = (cwd / "runs/s/trials/0/train.log").read_text()
    assert "resumed from step 4" in log
    assert "trial 1 (continues trial 0 from its step 4)" in r.stdout


def test_two_tuners_on_one_sqlite_study_run_disjoint_trials(tmp_path):
    cwd = _user_dir(tmp_path)
    args = [sys.executable, "-m", "jtrain.tune", "--config=search.py", "--workdir=runs/w",
            "--config.tune.trials=3", "--config.tune.pruner=none", "--config.total_steps=4"]
    procs = [subprocess.Popen(args, cwd=cwd, env=user_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    ran = [sorted(int(line.split()[3]) for line in out.splitlines()
                  if line.startswith("jtrain: tune: trial ") and " in trials/" in line)
           for out, _ in outs]
    assert sorted(ran[0] + ran[1]) == [0, 1, 2], ran  # each trial ran exactly once
    recs = _records(cwd / "runs/w/trials.jsonl")
    assert [x["state"] for x in recs] == ["complete"] * 3
    assert len({x["workdir"] for x in recs}) == 3


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_a_two_process_trial_runs_and_stops_the_same_on_both(tmp_path):
    """Process 0 alone samples and prunes; process 1 runs the trials it is sent and
    stops where process 0 does (its log says so)."""
    cwd = _user_dir(tmp_path)
    env = user_env(XLA_FLAGS="--xla_force_host_platform_device_count=1",
                   JTRAIN_COORDINATOR=f"127.0.0.1:{_free_port()}", JTRAIN_NUM_PROCESSES="2")
    args = ["timeout", "-k", "5", "300", sys.executable, "-m", "jtrain.tune",
            "--config=search.py", "--workdir=runs/mp", "--config.tune.trials=2",
            "--config.tune.prune_startup_trials=1"]
    procs = [subprocess.Popen(args, cwd=cwd, env={**env, "JTRAIN_PROCESS_ID": str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate() for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]  # 124: a hang
    recs = _records(cwd / "runs/mp/trials.jsonl")
    assert [(x["state"], x["step"]) for x in recs] == [("complete", 8), ("pruned", 2)]
    seen = [line for line in outs[1][0].splitlines() if line.startswith("jtrain: tune: [")]
    assert seen == [f"jtrain: tune: [process 1] trial {x['number']} {x['state']} at step "
                    f"{x['step']}: " + ", ".join(f"{k}={v!r}" for k, v in x["params"].items())
                    for x in recs]
