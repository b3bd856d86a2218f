"""checkpoint.store against a real S3-protocol server (moto's server mode on 127.0.0.1,
started here): a step is uploaded, then committed by its marker; a step without the marker
(a torn upload) or with a shard missing is never restored: the previous intact step is;
a server killed mid-upload and restarted leaves no committed step behind; the keep
policy's deletions reach the bucket; errors are one line naming the URI; a debug.faults
kill on a bucket's run fires once (its record reaches the bucket before the kill)."""

import json
import os
import pathlib
import shutil
import tempfile
import uuid

import pytest

from jtrain import checkpoint
from jtrain.checkpoint import store
from jtrain.errors import WorkdirError

from journey import run_python, s3_server
from test_checkpoint import abstract, make_config, make_state, same


@pytest.fixture(scope="module")
def s3():
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    with s3_server(bucket) as (server, env):
        yield server, env, bucket


def owner(uri):
    return store.Mirror(uri, owner=True, say=lines.append)


lines: list[str] = []


def train(uri, steps, **ckpt):
    """A session: pull, Checkpointer on the staging copy, saves, close; returns the
    step restored at its start."""
    mirror = owner(uri)
    try:
        mirror.pull()
        ck = checkpoint.Checkpointer(mirror.local, make_config(**ckpt), {"name": "unit"},
                                     mirror=mirror)
        start = ck.restore_or_init(abstract(make_state()), make_state)
        for s in steps:
            ck.save(s, make_state(s, float(s)), {"pos": s})
        ck.close()
        return start
    finally:
        mirror.close()


def restored(uri):
    """(step, state) a new session restores from `uri`."""
    mirror = owner(uri)
    try:
        mirror.pull()
        ck = checkpoint.Checkpointer(mirror.local, make_config(), {"name": "unit"},
                                     mirror=mirror)
        start = ck.restore_or_init(abstract(make_state()), make_state)
        ck.close()
        return start.step, start.state
    finally:
        mirror.close()


def committed(uri):
    return store.Mirror(uri, owner=False).committed_steps()[0]


def test_steps_commit_restore_and_the_keep_policy_reaches_the_bucket(s3):
    uri = f"s3://{s3[2]}/keep"
    train(uri, [1, 2, 3, 4], max_to_keep=2, keep_top_k=0)
    assert committed(uri) == [3, 4]  # 1 and 2 dropped by the keep policy, marker first
    step, state = restored(uri)
    assert step == 4 and same(state, make_state(4, 4.0))


def test_a_step_without_its_marker_or_with_a_shard_missing_is_never_restored(s3):
    fs = store.filesystem(f"s3://{s3[2]}")
    for case in ("marker", "shard"):
        uri = f"s3://{s3[2]}/torn-{case}"
        train(uri, [1, 2], keep_top_k=0)
        root = f"{s3[2]}/torn-{case}/checkpoints/2"
        if case == "marker":  # the upload stopped before its commit
            fs.rm(f"{root}/{store.COMMIT}")
        else:  # committed, then an object lost (or a marker written too early)
            fs.rm(max(fs.find(f"{root}/state"), key=lambda p: fs.size(p)))
        del lines[:]
        step, state = restored(uri)
        assert step == 1 and same(state, make_state(1, 1.0)), case
        if case == "marker":
            assert any("checkpoints/2: an unfinished upload" in ln for ln in lines), lines
            assert not fs.find(root)  # the owner removed the torn upload


def test_a_server_killed_mid_upload_and_restarted_leaves_no_committed_step(monkeypatch):
    from moto.server import ThreadedMotoServer

    bucket = f"k-{uuid.uuid4().hex[:12]}"
    with s3_server(bucket) as (server, env):
        killed_mid_upload(server, env, bucket, monkeypatch, ThreadedMotoServer)


def killed_mid_upload(server, env, bucket, monkeypatch, ThreadedMotoServer):
    uri = f"s3://{bucket}/killed"
    train(uri, [1], keep_top_k=0)
    port = int(env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    put = store.Mirror._call

    def dying(self, doing, fn, *args, **kwargs):  # half the files, then the server dies
        if doing.startswith("uploading checkpoint") and len(args) == 2:
            half = len(args[0]) // 2
            put(self, doing, fn, args[0][:half], args[1][:half])
            server.stop()
        return put(self, doing, fn, *args, **kwargs)

    monkeypatch.setattr(store.Mirror, "_call", dying)
    with pytest.raises(checkpoint.CheckpointError, match="cannot reach the object store"):
        train(uri, [2], keep_top_k=0, async_save=False)
    monkeypatch.undo()
    again = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    again.start()
    try:
        fs = store.filesystem(uri)
        assert fs.find(f"{bucket}/killed/checkpoints/2")  # a part of it was uploaded
        assert committed(uri) == [1]
        step, state = restored(uri)
        assert step == 1 and same(state, make_state(1, 1.0))
    finally:
        again.stop()


def test_errors_are_one_line_naming_the_uri(s3, monkeypatch):
    bucket = s3[2]
    with pytest.raises(WorkdirError, match=r"^s3://no-such-bucket-x/r: no such bucket$"):
        store.check("s3://no-such-bucket-x/r")
    with pytest.raises(WorkdirError) as e:
        store.check(f"s3://AKIAEXAMPLEKEY:wJalrXUtnFEMI9K@{bucket}/r")
    assert "credentials in the URI are refused" in str(e.value)
    assert "wJalrXUtnFEMI9K" not in str(e.value) and "AKIAEXAMPLEKEY" not in str(e.value)
    with pytest.raises(WorkdirError, match=r"^ftp://h/r: ftp:// is not a supported store"):
        store.check("ftp://h/r")
    from moto import settings

    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # keys checked now
    with pytest.raises(WorkdirError, match=rf"^s3://{bucket}/r: access denied"):
        store.check(f"s3://{bucket}/r")


def test_push_uploads_what_changed_and_a_reader_deletes_nothing(s3, monkeypatch):
    uri = f"s3://{s3[2]}/files"
    train(uri, [1, 2], keep_top_k=0)
    mirror = owner(uri)
    mirror.pull()
    tmp = pathlib.Path(mirror.local)
    (tmp / "tb").mkdir()
    (tmp / "tb" / "events.out.tfevents.1").write_bytes(b"event-1")
    (tmp / "metrics.jsonl").write_text('{"step": 1}\n')
    sent = []
    put = store.Mirror._call

    def counting(self, doing, fn, *args, **kwargs):
        if doing == "uploading":
            sent.append(sorted(p.rsplit("/files/", 1)[1] for p in args[1]))
        return put(self, doing, fn, *args, **kwargs)

    monkeypatch.setattr(store.Mirror, "_call", counting)
    mirror.push()
    (tmp / "tb" / "events.out.tfevents.1").write_bytes(b"event-1 event-2")
    mirror.push()
    mirror.push()
    mirror.close()
    assert sent == [["metrics.jsonl", "tb/events.out.tfevents.1"],
                    ["tb/events.out.tfevents.1"]]
    fs = store.filesystem(uri)
    assert fs.cat(f"{s3[2]}/files/tb/events.out.tfevents.1") == b"event-1 event-2"

    with store.local_copy(uri, write_back=True) as run:  # e.g. jtrain evaluate
        assert sorted(os.listdir(f"{run}/checkpoints")) == ["1", "2"]
        shutil.rmtree(f"{run}/checkpoints/1")
        (pathlib.Path(run) / "eval_2.json").write_text("{}")
    assert fs.exists(f"{s3[2]}/files/eval_2.json") and committed(uri) == [1, 2]


def test_the_verifier_names_and_reads_a_bucket_runs_staging_copy(s3, tmp_path, monkeypatch):
    """--verify_resume on a bucket: the training run's staging copy is the path the
    verifier gives it (a reader's is not); each process of a run gets a fresh one; the
    committed steps and summary.json are read from the bucket; fresh() empties it."""
    from jtrain.verify import resume as verify

    uri = f"s3://{s3[2]}/verify/interrupted"
    run = verify._BucketRun(uri, str(tmp_path))
    env = run.next_process()
    monkeypatch.setenv(store.STAGING_ENV, env[store.STAGING_ENV])
    assert store.Mirror(uri, owner=False).local != run.watched
    mirror = owner(uri)  # the training run's
    assert mirror.local == run.watched and os.path.isdir(run.watched)
    mirror.close()
    train(uri, [2, 4], max_to_keep=5, keep_top_k=0)
    assert run.finished_steps() == [2, 4] and run.summary() is None
    store.filesystem(uri).pipe(f"{s3[2]}/verify/interrupted/summary.json", b'{"step": 4}')
    assert run.summary() == {"step": 4}
    first = run.watched
    assert run.next_process()[store.STAGING_ENV] == run.watched != first
    run.fresh()
    assert run.finished_steps() == [] and run.summary() is None


KILLED = """
import sys

import jax.numpy as jnp
import numpy as np

import jtrain

r = np.random.default_rng(0)
data = {"x": r.normal(size=(64, 3)).astype(np.float32),
        "targets": r.normal(size=(64, 2)).astype(np.float32)}
model = (lambda rng, inputs: {"w": jnp.zeros((3, 2), jnp.float32)},
         lambda params, inputs, rng=None, train=False: inputs["x"] @ params["w"])
config = {"total_steps": 6, "data": {"batch_size": 8, "val_fraction": 0.0},
          "eval": {"every_steps": 0}, "checkpoint": {"every_steps": 2, "async_save": False},
          "log": {"verbosity": 0, "writers": ("jsonl",)}, "debug": {"faults": "kill@3"}}
jtrain.train(config, sys.argv[1], model=model, train_data=data)
"""


def test_a_fault_that_fired_on_a_bucket_run_does_not_fire_again_on_restart(s3, tmp_path):
    """kill@3 with a checkpoint at step 2: the first launch is killed after step 3, the
    restart resumes from step 2 and runs step 3 again, this time through to the end
    (the fault's record was uploaded before the kill, the restart pulls it). Saves are
    synchronous: step 2 is committed before step 3 runs."""
    uri = f"s3://{s3[2]}/faults"
    (tmp_path / "train.py").write_text(KILLED)
    (tmp_path / "tmp").mkdir()  # a killed run leaves its staging copy in TMPDIR
    env = {**s3[1], "TMPDIR": str(tmp_path / "tmp")}
    first = run_python(tmp_path, "train.py", uri, **env)
    assert first.returncode == -9, first.stderr[-2000:]
    assert committed(uri) == [2]
    again = run_python(tmp_path, "train.py", uri, **env)
    assert again.returncode == 0, again.stderr[-2000:]
    fs = store.filesystem(uri)
    fired = [json.loads(line) for line in fs.cat(f"{s3[2]}/faults/faults.jsonl").splitlines()]
    assert [(f["fault"], f["step"]) for f in fired] == [("kill@3", 3)]
    assert json.loads(fs.cat(f"{s3[2]}/faults/summary.json"))["step"] == 6


def plant(bucket: str, prefix: str, keys: list[str]) -> None:
    """Objects at exactly these keys (boto3 keeps `..` segments as they are)."""
    import boto3

    client = boto3.client("s3")
    client.put_object(Bucket=bucket, Key=f"{prefix}/config.json", Body=b"{}")
    client.put_object(Bucket=bucket, Key=f"{prefix}/checkpoints/4/{store.COMMIT}", Body=b"{}")
    for key in keys:
        client.put_object(Bucket=bucket, Key=key, Body=b"payload")


@pytest.mark.parametrize("key", ["{p}/../../victim/marker",
                                 "{p}/checkpoints/4/../../../../victim/marker",
                                 "{p}/a\\..\\..\\victim\\marker"])
def test_a_key_leading_outside_the_staging_copy_refuses_the_run(s3, tmp_path, monkeypatch,
                                                                key):
    """The staging copy is TMP/jtrain-run-XXX: joined as they are, the first two keys
    land in TMP/../victim/marker (the third does on Windows). The pull refuses the run
    in one line naming the key and writes nothing anywhere."""
    prefix = f"hostile-{uuid.uuid4().hex[:8]}"
    key = key.format(p=prefix)
    plant(s3[2], prefix, [key])
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    with pytest.raises(WorkdirError) as e:
        with store.local_copy(f"s3://{s3[2]}/{prefix}"):
            pass
    assert str(e.value).startswith(f"s3://{s3[2]}/{prefix}: key {key[len(prefix) + 1:]!r}: ")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "victim").exists() and os.listdir(tmp) == []


def test_export_of_a_bucket_run_with_a_hostile_key_is_one_line(s3, tmp_path):
    """The user's command: `jtrain export s3://b/run --out=x` on a bucket holding a key
    with `..` segments exits 2 with one line, and nothing is written outside."""
    from journey import run_python

    key = "exported/../../victim/marker"
    plant(s3[2], "exported", [key])
    (tmp_path / "tmp").mkdir()
    proc = run_python(tmp_path, "-m", "jtrain", "export", f"s3://{s3[2]}/exported",
                      "--out=x", TMPDIR=str(tmp_path / "tmp"), **s3[1])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"jtrain: workdir error: s3://{s3[2]}/exported: key '../../victim/marker': holds an "
        "empty, '.' or '..' segment: a name read from a run, a bucket or a study must be a "
        "plain relative path inside its folder"]
    assert not (tmp_path / "victim").exists() and not (tmp_path / "x").exists()
