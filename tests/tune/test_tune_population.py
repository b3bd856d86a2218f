"""tune.population > 1: a search whose trials train as the members of population runs
(each trial told its own member's tune.monitor, every eval reported, the best trial's
best_config.py retraining it alone), a space key a population cannot vary as one config
error, a killed batch continued whole (same workdir, same members in the same order), and
a second live worker refused."""

import json
import os
import socket
import subprocess
import sys
import time

import optuna
import pytest

import jtrain
from journey import copy_project, run_python
from jtrain import config as config_lib
from jtrain.errors import ConfigError
from jtrain.tune import batch
from jtrain.tune import study as study_lib

SPACE = {"optim.lr": ("log_uniform", 1e-3, 3e-1), "optim.weight_decay": ("uniform", 0.0, 0.1)}

CONFIG = '''
from jtrain.config import defaults

def get_config():
    config = defaults(model="mlp")
    config.update({"model": {"num_outputs": 2, "hidden": (4,)},
                   "data": {"source": "tabular:make", "batch_size": 8,
                            "kwargs": {"n": 32, "features": 3, "eval_rows": 8}},
                   "total_steps": 4, "eval": {"every_steps": 2, "metrics": ("loss",)},
                   "log": {"writers": ("jsonl",)},
                   "tune": {"space": {"optim": {"lr": ("log_uniform", 1e-3, 3e-1),
                                                "weight_decay": ("uniform", 0.0, 0.1)}},
                            "trials": 4, "population": 2}})
    return config
'''


def _records(path):
    return [json.loads(line) for line in open(path)]


def test_a_population_search_tells_each_trial_its_members_value(tmp_path, monkeypatch):
    """From the command line, as a user runs it (a temp cwd, relative paths)."""
    copy_project(tmp_path, "tabular")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "search.py").write_text(CONFIG)
    work = tmp_path / "runs"
    proc = run_python(tmp_path, "-m", "jtrain.tune", "--config=search.py", "--workdir=runs",
                      timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "tune.population=2" in out and "no trial is pruned" in out, out[-3000:]
    assert "Traceback" not in out
    recs = _records(work / "trials.jsonl")
    assert [r["state"] for r in recs] == ["complete"] * 4
    assert [(r["workdir"], r["member"]) for r in recs] == [
        ("populations/0", 0), ("populations/0", 1), ("populations/2", 0), ("populations/2", 1)]
    study = optuna.load_study(study_name="runs", storage=f"sqlite:///{work}/study.db")
    for r, t in zip(recs, study.get_trials(), strict=True):
        logged = [x for x in _records(work / r["workdir"] / "metrics.jsonl")
                  if f"eval/loss/m{r['member']}" in x]
        assert r["value"] == logged[-1][f"eval/loss/m{r['member']}"]  # its member's own
        assert t.intermediate_values == {x["step"]: x[f"eval/loss/m{r['member']}"]
                                         for x in logged}  # every eval reported
    assert len({json.dumps(r["params"], sort_keys=True) for r in recs}) == 4
    summary = json.load(open(work / "populations/0/summary.json"))
    assert summary["population"]["seeds"] == [0, 0]  # every trial has the run's seed
    assert summary["population"]["lrs"] == [recs[0]["params"]["optim.lr"],
                                            recs[1]["params"]["optim.lr"]]
    # best_config.py retrains the best trial alone: its member's value to float32 rounding.
    best = min(recs, key=lambda r: r["value"])
    ns: dict = {}
    exec(open(work / "best_config.py").read(), ns)
    assert ns["TRIAL"]["member"] == best["member"]  # the file says which member it was
    result = jtrain.train(ns["get_config"](), str(tmp_path / "best"))
    assert result.summary["eval/loss"] == pytest.approx(best["value"], rel=1e-5)


def test_a_key_a_population_cannot_vary_is_one_config_error():
    with pytest.raises(ConfigError) as e:
        config_lib.resolve({"tune": {"population": 2, "space": {
            **SPACE, "data.batch_size": ("choice", (8, 16))}}})
    assert str(e.value) == (
        "tune.population: 2 trials per population, and a population cannot vary tune.space "
        "key data.batch_size (only optim.lr, optim.weight_decay); search only those keys or "
        "set tune.population = 1")
    base = config_lib.resolve({"optim": {"name": "adam"}, "tune": {
        "population": 2, "space": SPACE}}).to_dict()
    with pytest.raises(ConfigError, match="^tune.population: this config cannot train as a "
                                          "population: population.vary.optim.weight_decay"):
        batch.check_base(base)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_killed_batch_is_continued_whole_and_a_second_worker_refused(tmp_path):
    cfg = config_lib.resolve({"tune": {"space": SPACE, "trials": 3, "population": 2}}).tune
    study = study_lib.open_study(cfg, str(tmp_path), SPACE)
    trials, job = batch.next_batch(study, cfg, SPACE, str(tmp_path))
    assert [m["number"] for m in job.members] == [0, 1] and job.workdir == "populations/0"
    dead = _dead_pid()
    for t in trials:  # the worker is killed mid-batch
        t.set_user_attr(study_lib.PID, dead)
    trials2, job2 = batch.next_batch(study, cfg, SPACE, str(tmp_path))
    assert job2.workdir == "populations/0" and job2.continues == 0
    assert [(m["continues"], m["params"]) for m in job2.members] == [
        (0, job.members[0]["params"]), (1, job.members[1]["params"])]
    assert [t.number for t in trials2] == [m["number"] for m in job2.members] == [2, 3]
    # Another live worker's running trials: this worker stops with one line.
    for t in trials2:
        t.set_user_attr(study_lib.PID, os.getppid())
        t.set_user_attr(study_lib.HOST, socket.gethostname())
        t.set_user_attr(study_lib.BEAT, time.time())
    with pytest.raises(ConfigError, match="^tune.population: trial 2 of this study is "
                                          "running in another worker"):
        batch.next_batch(study, cfg, SPACE, str(tmp_path))
    # The rest of the study: one slot left, a batch of one.
    for t in trials2:
        study.tell(t, 1.0)
    trials3, job3 = batch.next_batch(study, cfg, SPACE, str(tmp_path))
    assert [m["number"] for m in job3.members] == [4] and job3.workdir == "populations/4"
    assert batch.population_config({"seed": 3}, [{"optim.lr": 0.1}, {"optim.lr": 0.1}]) == \
        {"seed": 3, "optim": {"lr": 0.1}}  # the same values twice: one plain run
    assert batch.monitors([{"a": 1}, {"a": 2}, {"a": 1}], "eval/loss") == [
        "eval/loss/m0", "eval/loss/m1", "eval/loss/m0"]
