"""Hyperparameter search as a user runs it: `python -m jtrain.tune` in a subprocess from a
temp cwd holding their NNX model, data and config modules, relative paths, no test
helpers. A search with pruning whose best_config.py retrains to the best trial's
state_sha256; a tuner SIGKILLed mid-trial and rerun (the study ends with its trial count,
the killed trial continues from its own checkpoint); two tuners on one SQLite study."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

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


def test_search_prunes_and_best_config_retrains_bitwise(tmp_path):
    cwd = _user_dir(tmp_path)
    r = run_python(cwd, "-m", "jtrain.tune", "--config=search.py", "--workdir=runs/s")
    assert r.returncode == 0, r.stderr[-2000:]
    recs = _records(cwd / "runs/s/trials.jsonl")
    assert [x["number"] for x in recs] == list(range(6))
    states = [x["state"] for x in recs]
    assert set(states) <= {"complete", "pruned"} and "pruned" in states, states
    for x in recs:
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


def test_killed_tuner_reruns_to_the_trial_count_resuming_the_killed_trial(tmp_path):
    cwd = _user_dir(tmp_path)
    args = [sys.executable, "-m", "jtrain.tune", "--config=search.py", "--workdir=runs/k",
            "--config.tune.trials=2", "--config.tune.pruner=none",
            "--config.total_steps=40", "--config.eval.every_steps=20"]
    p = subprocess.Popen(args, cwd=cwd, env=user_env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    ckpts = cwd / "runs/k/trials/0/checkpoints"
    deadline = time.time() + 240
    while not (ckpts.exists() and any(n.isdigit() for n in os.listdir(ckpts))):
        assert p.poll() is None and time.time() < deadline, "trial 0 never saved"
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)  # mid-trial: steps 5..40 of trial 0 still to run
    p.wait()

    r = run_python(cwd, *args[1:])
    assert r.returncode == 0, r.stderr[-2000:]
    recs = _records(cwd / "runs/k/trials.jsonl")
    assert [x["state"] for x in recs] == ["interrupted", "complete", "complete"], recs
    killed, cont, new = recs
    assert "interrupted" in killed["reason"] and killed["workdir"] == "trials/0"
    assert cont["continues"] == 0 and cont["workdir"] == "trials/0"
    assert cont["params"] == killed["params"] and cont["step"] == 40
    assert new["workdir"] == "trials/2" and new["params"] != killed["params"]
    resumed = cont["resumed_from"]
    assert 4 <= resumed < 40, cont
    log = (cwd / "runs/k/trials/0/train.log").read_text()
    assert f"resumed from step {resumed}" in log
    assert f"trial 1 (continues trial 0 from its step {resumed})" in r.stdout


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
