"""A search whose workdir is a bucket (`jtrain tune --workdir=s3://...`), against a real
S3-protocol server (moto's server mode on 127.0.0.1, started here; the endpoint and
dummy credentials in the environment).

The journey: the command of docs/guide/object-storage.md from a temp cwd with the user's
model and data module; every trial's run, its metrics and the study's files are in the
bucket and nothing is written to the cwd; each trial's value is its last eval in the
bucket's metrics.jsonl. The command is SIGKILLed mid-trial and rerun: the rerun continues
the killed trial from its checkpoint committed in the bucket (as a local study does,
tests/tune/test_tune_journey.py) and that trial ends with the value and state of trial 0
trained straight through (the same sampled values, an exact resume).

In-process: a missing bucket, an unreachable endpoint, several processes per trial and a
study whose SQLite lease a live worker holds are one line each, exit 2; a trial's newest
committed step and its final value are read from the bucket."""

import json
import os
import socket
import subprocess
import time
import uuid
from pathlib import Path

import fsspec
import pytest

from jtrain import config as config_lib
from jtrain import tune
from jtrain.tune import trial as trial_lib

from journey import (free_address, nnx_mlp_config, own_modules, s3_server, user_dir,
                     user_env)
from test_doc_examples import _argv, bash_lines, blocks

PAGE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "object-storage.md"
# The user's NNX model and data (tests/projects/nnx_mlp.py), 8 steps, evals at 4 and 8,
# a checkpoint every 2 steps, and a search over the learning rate.
CONFIG = nnx_mlp_config(total_steps=8, eval_every=4, log_every=4, checkpoint_every=2).replace(
    "    return c\n", "    c.tune.update(space={'optim': {'lr': ('log_uniform', 1e-3, 3e-1)}},\n"
    "                  trials=2, pruner='none')\n    return c\n")


@pytest.fixture(scope="module")
def s3():
    bucket = f"my-bucket-{uuid.uuid4().hex[:8]}"
    with s3_server(bucket) as (_, env):
        yield bucket, env


def page_command(bucket: str) -> list[str]:
    """The page's one tested line, its bucket name replaced by this test's."""
    body = [b for m, lang, b in blocks(PAGE) if lang == "bash"
            and m == "tested: tests/journeys/test_objstore_tune_journey.py"]
    assert len(body) == 1
    [argv] = bash_lines(body[0])
    return _argv([a.replace("my-bucket", bucket) for a in argv])


def _records(fs, path: str) -> list[dict]:
    return [json.loads(line) for line in fs.cat(path).decode().splitlines()]


def test_a_search_in_a_bucket_killed_and_rerun(s3, tmp_path, monkeypatch):
    bucket, env = s3
    user_dir(tmp_path, ["nnx_mlp"], {"search.py": CONFIG})
    (tmp_path / "tmp").mkdir()  # a killed worker leaves its staging copies here
    env = user_env(**env, TMPDIR=str(tmp_path / "tmp"))
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    argv = page_command(bucket)
    study = argv[-1].split("=", 1)[1]
    assert study == f"s3://{bucket}/studies/s1"
    root = study[len("s3://"):]

    # The page's command SIGKILLed at trial 0's step 7, then run again to the end.
    killed = subprocess.run(argv, cwd=tmp_path, env={**env, "JTRAIN_FAULT": "step:7"},
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert fs.exists(f"{root}/study.db") and fs.exists(f"{root}/worker.json")
    left = set(os.listdir(tmp_path / "tmp"))  # the killed worker's staging copies
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert {p.rsplit("/", 1)[1] for p in fs.ls(root, refresh=True)} == {
        "study.db", "trials.jsonl", "best_config.py", "tune.png", "trials"}  # no lease
    recs = _records(fs, f"{root}/trials.jsonl")
    assert [(r["state"], r["workdir"]) for r in recs] == [
        ("interrupted", "trials/0"), ("complete", "trials/0"), ("complete", "trials/2")]
    for r in recs[1:]:  # the value told to the study: the last eval of the bucket's run
        run = f"{root}/{r['workdir']}"
        evals = [x["eval/loss"] for x in _records(fs, f"{run}/metrics.jsonl")
                 if "eval/loss" in x]
        assert r["value"] == evals[-1] and len(evals) == 2 and r["step"] == 8, (r, evals)
        assert fs.exists(f"{run}/checkpoints/8/jtrain_committed.json")
    best = min(recs[1:], key=lambda r: r["value"])
    assert f"best trial {best['number']}: eval/loss={best['value']:.6g}" in done.stdout
    assert f"wrote trials.jsonl, best_config.py, tune.png in {study}" in done.stdout
    assert "TRIAL = " in fs.cat(f"{root}/best_config.py").decode()
    assert sorted(os.listdir(tmp_path)) == ["nnx_mlp.py", "search.py", "tmp"]
    assert set(os.listdir(tmp_path / "tmp")) <= left  # the rerun removed every copy

    cont = recs[1]
    assert cont["continues"] == 0 and cont["params"] == recs[0]["params"]
    resumed = cont["resumed_from"]
    assert 2 <= resumed < 7, cont
    assert f"trial 1 (continues trial 0 from its step {resumed})" in done.stdout
    assert f"resumed from step {resumed}" in fs.cat(f"{root}/trials/0/train.log").decode()
    assert not fs.exists(f"{root}/worker.json")

    # The continued trial ends as trial 0 trained straight through does (on a local
    # disk, in this process, as the worker trains a trial): the same value and state.
    monkeypatch.syspath_prepend(str(tmp_path))
    ns: dict = {}
    exec(CONFIG, ns)
    base = config_lib.resolve(ns["get_config"]()).to_dict()
    with own_modules("nnx_mlp"):
        straight = trial_lib.run(base, cont["params"], str(tmp_path / "straight"),
                                 "eval/loss")
    assert (straight.state, straight.step) == ("complete", 8)
    assert cont["value"] == straight.value
    assert json.loads(fs.cat(f"{root}/trials/0/summary.json"))["state_sha256"] == \
        json.loads((tmp_path / "straight/summary.json").read_text())["state_sha256"]


def _cfg(tmp_path) -> str:
    """A config the in-process checks refuse before any trial (one trial if not)."""
    (tmp_path / "s.py").write_text(
        "from jtrain.config import defaults\n\ndef get_config():\n"
        "    c = defaults(model='mlp')\n"
        "    c.tune.update(trials=1, space={'optim': {'lr': ('uniform', 0.01, 0.1)}})\n"
        "    return c\n")
    return f"--config={tmp_path / 's.py'}"


def test_a_missing_bucket_an_endpoint_or_processes_is_one_line(s3, tmp_path, capsys, monkeypatch):
    bucket, _ = s3
    nothere = f"s3://{bucket}-none/study"
    assert tune.main([_cfg(tmp_path), f"--workdir={nothere}"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"jtrain: workdir error: {nothere}: no such bucket"]
    assert tune.main([_cfg(tmp_path), f"--workdir=s3://{bucket}/mp", "--num_processes=2"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"jtrain: workdir error: s3://{bucket}/mp: a search on an object store runs "
        "single-process trials; use a mounted path (e.g. gcsfuse) for several processes"]
    nowhere = f"http://{free_address()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", nowhere)
    assert tune.main([_cfg(tmp_path), f"--workdir=s3://{bucket}/study"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"jtrain: workdir error: s3://{bucket}/study: cannot reach the object store"), err


def test_a_second_worker_on_a_bucket_sqlite_study_is_refused(s3, tmp_path, capsys):
    bucket, _ = s3
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    lease = {"host": socket.gethostname(), "pid": os.getppid(), "token": "x",
             "time": time.time()}  # a live worker of this host
    fs.pipe_file(f"{bucket}/busy/worker.json", json.dumps(lease).encode())
    assert tune.main([_cfg(tmp_path), f"--workdir=s3://{bucket}/busy"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"jtrain: config error: tune.storage: unset: the study's SQLite database is kept "
        f"in s3://{bucket}/busy, one worker at a time, and worker {lease['host']}:"
        f"{lease['pid']} runs it; for several workers set tune.storage to a database "
        "they share (e.g. postgresql://...)"]
    assert fs.ls(f"{bucket}/busy", refresh=True) == [f"{bucket}/busy/worker.json"]


def test_a_trials_checkpoint_and_value_are_read_from_the_bucket(s3):
    bucket, _ = s3
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    run = f"{bucket}/read/trials/0"
    for step in (2, 4, 6):
        fs.pipe_file(f"{run}/checkpoints/{step}/state/data", b"x")
    for step in (2, 4):  # step 6: an upload without its commit marker
        fs.pipe_file(f"{run}/checkpoints/{step}/jtrain_committed.json", b"{}")
    lines = [{"step": 4, "eval/loss": 0.5}, {"step": 8, "eval/loss": 0.25},
             {"step": 8, "train/loss": 0.1}]
    fs.pipe_file(f"{run}/metrics.jsonl",
                 "".join(json.dumps(x) + "\n" for x in lines).encode() + b'{"step": 9')
    uri = f"s3://{run}"
    assert trial_lib.trial_dir(f"s3://{bucket}/read/", "trials/0") == uri
    assert trial_lib.last_checkpoint(uri) == 4
    assert trial_lib.final_value(uri, "eval/loss") == 0.25
    assert trial_lib.last_checkpoint(f"s3://{bucket}/read/trials/1") is None
    assert trial_lib.final_value(f"s3://{bucket}/read/trials/1", "eval/loss") is None
