"""Tests for jtrain.observe.writers: JSONL, TensorBoard, background thread, secrets, MLflow/W&B."""

import glob
import json
import math
import os
import struct
import sys
import threading
import time

import numpy as np
import pytest
from ml_collections import ConfigDict

from jtrain.observe import writers
from jtrain.observe.console import Progress
from jtrain.redact import redact, redact_text
from jtrain.observe.writers import MetricWriter

SECRETS = ("sk-test-123abc", "s3cr3t-value", "hunter2", "tok-999")


def log_cfg(*names, **kw):
    cfg = ConfigDict({"writers": list(names or ("jsonl", "tensorboard")), "every_steps": 1,
                      "mlflow_tracking_uri": "", "mlflow_experiment": "jtrain",
                      "wandb_project": "jtrain", "wandb_mode": "offline"})
    cfg.update(kw)
    return cfg


def read_jsonl(workdir):
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_events(workdir):
    """Events of every TensorBoard file under workdir/tb, read without tensorboardX's reader."""
    try:
        from tensorboard.compat.proto import event_pb2
    except ImportError:
        from tensorboardX.proto import event_pb2
    events = []
    for path in sorted(glob.glob(os.path.join(workdir, "tb", "*tfevents*"))):
        data = open(path, "rb").read()
        pos = 0
        while pos < len(data):  # TFRecord: u64 length, u32 crc, data, u32 crc
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            pos += 12
            event = event_pb2.Event()
            event.ParseFromString(data[pos:pos + length])
            events.append(event)
            pos += length + 4
    return events


def tb_scalars(workdir):
    return {(v.tag, e.step): v.simple_value for e in read_events(workdir)
            for v in e.summary.value if v.HasField("simple_value")}


def test_jsonl_lines_nan_and_resume_appends(tmp_path):
    wd = str(tmp_path)
    w = MetricWriter(wd, log_cfg("jsonl"), is_primary=True)
    w.write_scalars(1, {"train/loss": np.float32(2.5), "train/lr": 1e-3})
    w.write_scalars(2, {"train/loss": float("nan"), "train/x": math.inf, "train/y": -math.inf})
    w.flush()
    rows = read_jsonl(wd)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["train/loss"] == 2.5 and rows[0]["train/lr"] == 1e-3
    assert isinstance(rows[0]["time"], float)
    assert (rows[1]["train/loss"], rows[1]["train/x"], rows[1]["train/y"]) == ("nan", "inf", "-inf")
    w.close()
    # A kill mid-write leaves a torn line; a resumed writer appends on a fresh line.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "tra')
    w = MetricWriter(wd, log_cfg("jsonl"), is_primary=True)
    w.write_scalars(3, {"train/loss": 1.0})
    w.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[-1])["step"] == 3
    assert [r["step"] for r in read_jsonl_lenient(lines)] == [1, 2, 3]


def read_jsonl_lenient(lines):
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def test_tensorboard_scalars_text_hparams(tmp_path):
    wd = str(tmp_path)
    w = MetricWriter(wd, log_cfg(), is_primary=True)
    w.write_hparams({"optim": {"lr": 0.1, "name": "adam", "betas": (0.9, 0.99)}, "seed": 3})
    for step in (10, 20):
        w.write_scalars(step, {"train/loss": 1.0 / step, "eval/accuracy": step / 100})
    w.write_text(5, "info/data", "a 10-sample dataset")
    w.flush()  # flushed means on disk: readable before close
    scalars = tb_scalars(wd)
    assert scalars[("train/loss", 10)] == pytest.approx(0.1)
    assert scalars[("train/loss", 20)] == pytest.approx(0.05)
    assert scalars[("eval/accuracy", 20)] == pytest.approx(0.2)
    w.close()
    events = read_events(wd)
    tags = {v.tag for e in events for v in e.summary.value}
    assert {"info/data/text_summary", "_hparams_/session_start_info"} <= tags
    text = [v.tensor.string_val[0] for e in events for v in e.summary.value
            if v.tag == "info/data/text_summary"]
    assert text == [b"a 10-sample dataset"]
    from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData
    ssi = [v.metadata.plugin_data.content for e in events for v in e.summary.value
           if v.tag == "_hparams_/session_start_info"][0]
    hp = HParamsPluginData.FromString(ssi).session_start_info.hparams
    assert hp["optim.lr"].number_value == 0.1 and hp["optim.name"].string_value == "adam"
    assert hp["optim.betas"].string_value == "(0.9, 0.99)" and hp["seed"].number_value == 3
    # A resumed writer adds a new event file next to the first one.
    w2 = MetricWriter(wd, log_cfg(), is_primary=True)
    w2.write_scalars(30, {"train/loss": 0.5})
    w2.close()
    assert len(glob.glob(os.path.join(wd, "tb", "*tfevents*"))) == 2
    assert tb_scalars(wd)[("train/loss", 10)] == pytest.approx(0.1)
    assert tb_scalars(wd)[("train/loss", 30)] == 0.5


class SlowBackend(writers._Backend):
    name = "slow"

    def __init__(self, delay=0.2, fail=False):
        self.delay, self.fail, self.steps = delay, fail, []
        self.thread = None

    def scalars(self, step, wall, scalars):
        time.sleep(self.delay)
        self.thread = threading.current_thread()
        if self.fail:
            raise OSError("disk on fire")
        self.steps.append(step)


def test_writes_do_not_block_and_flush_waits(tmp_path):
    w = MetricWriter(str(tmp_path), log_cfg("jsonl"), is_primary=True)
    slow = SlowBackend(delay=0.2)
    w._backends.append(slow)
    t0 = time.perf_counter()
    for step in range(3):
        w.write_scalars(step, {"train/loss": 1.0})
    assert time.perf_counter() - t0 < 0.1
    assert slow.steps == []
    w.flush()
    assert time.perf_counter() - t0 >= 0.55
    assert slow.steps == [0, 1, 2]
    assert slow.thread is not threading.current_thread() and slow.thread.daemon
    w.close()
    w.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        w.write_scalars(4, {"train/loss": 1.0})


def test_thread_error_surfaces_at_flush_and_close(tmp_path):
    w = MetricWriter(str(tmp_path / "a"), log_cfg("jsonl"), is_primary=True)
    w._backends.append(SlowBackend(delay=0.0, fail=True))
    w.write_scalars(1, {"train/loss": 1.0})
    with pytest.raises(RuntimeError, match="'slow' failed: OSError: disk on fire"):
        w.flush()
    w.close()  # reported once; other backends are still closed
    assert read_jsonl(str(tmp_path / "a"))[0]["step"] == 1

    w = MetricWriter(str(tmp_path / "b"), log_cfg("jsonl"), is_primary=True)
    w._backends.append(SlowBackend(delay=0.0, fail=True))
    w.write_scalars(1, {"train/loss": 1.0})
    with pytest.raises(RuntimeError, match="metric writer 'slow' failed"):
        w.close()
    w.close()


def test_write_scalars_rejects_non_scalars(tmp_path):
    with MetricWriter(str(tmp_path), log_cfg("jsonl"), is_primary=True) as w:
        with pytest.raises(TypeError, match="'train/x' is not a scalar"):
            w.write_scalars(1, {"train/x": np.zeros(3)})


def test_non_primary_writes_nothing(tmp_path):
    wd = tmp_path / "run"
    w = MetricWriter(str(wd), log_cfg("jsonl", "tensorboard", "mlflow", "wandb"),
                     is_primary=False, run_ids={"mlflow": "abc"})
    w.write_hparams({"a": 1})
    w.write_scalars(1, {"train/loss": 1.0})
    w.write_text(1, "k", "v")
    w.flush()
    assert w.run_ids() == {"mlflow": "abc"}
    w.close()
    w.write_scalars(2, {"train/loss": 1.0})
    p = Progress(10, start_step=0, is_primary=False)
    p.update(1, {"train/loss": 1.0})
    p.message("hello")
    p.close()
    assert not wd.exists()


def test_bad_writer_names(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="log.writers: unknown writer 'csv'"):
        MetricWriter(str(tmp_path / "x"), log_cfg("jsonl", "csv"), is_primary=True)
    for name in ("mlflow", "wandb"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
        with pytest.raises(ImportError) as info:
            MetricWriter(str(tmp_path / "x"), log_cfg("tensorboard", name), is_primary=True)
        assert str(info.value) == (f"log.writers: {name!r} needs the {name} package: "
                                   f"pip install 'jtrain[{name}]'")
    assert not (tmp_path / "x").exists()


def test_defaults_when_log_cfg_is_sparse(tmp_path):
    w = MetricWriter(str(tmp_path), ConfigDict({"every_steps": 5}), is_primary=True)
    w.write_scalars(1, {"train/loss": 1.0})
    w.close()
    assert (tmp_path / "metrics.jsonl").exists() and (tmp_path / "tb").is_dir()
    assert w.run_ids() == {}


def test_redact(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "sk-test-123abc")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    cfg = ConfigDict({
        "log": {"api_key": "s3cr3t-value", "apikey": 123456, "writers": ("jsonl",)},
        "data": {"uri": "postgres://bob:hunter2@db/x", "tokenizer": "gpt2", "max_tokens": 512,
                 "note": "uses sk-test-123abc", "paths": ["s3://u:p@ss@bucket/a", "plain"]},
        "token": "tok-999", "hf_token": None, "use_secret": True,
        "credentials": {"user": "bob", "n": 7}, "flag": "false",
    })
    out = redact(cfg)
    assert out["log"] == {"api_key": "<redacted>", "apikey": "<redacted>", "writers": ("jsonl",)}
    assert out["data"]["uri"] == "postgres://<redacted>@db/x"
    assert out["data"]["tokenizer"] == "gpt2" and out["data"]["max_tokens"] == 512
    assert out["data"]["note"] == "uses <redacted>"
    assert out["data"]["paths"] == ["s3://<redacted>@bucket/a", "plain"]
    assert out["token"] == "<redacted>" and out["hf_token"] is None and out["use_secret"] is True
    assert out["credentials"] == {"user": "<redacted>", "n": "<redacted>"}
    assert out["flag"] == "false"  # short env values are not treated as secrets
    assert cfg.log.api_key == "s3cr3t-value"  # a copy
    assert redact({"PASSWORD": "x", "Secret_Thing": "y", "monkey": "z"}) == {
        "PASSWORD": "<redacted>", "Secret_Thing": "<redacted>", "monkey": "z"}
    assert redact_text("see https://:pw123@h.io/x and sk-test-123abc.") == (
        "see https://<redacted>@h.io/x and <redacted>.")


def _available_extras():
    names = []
    for name in ("mlflow", "wandb"):
        try:
            __import__(name)
            names.append(name)
        except ImportError:
            pass
    return names


@pytest.mark.slow  # seconds of CPU: the full suite runs it (tests/README.md)
def test_secrets_never_written(tmp_path, monkeypatch, capsys):
    import io
    monkeypatch.setenv("WANDB_API_KEY", "sk-test-123abc")
    wd = tmp_path / "run"
    config = {"log": {"api_key": "s3cr3t-value"}, "data": {"uri": "postgres://bob:hunter2@db/x"},
              "token": "tok-999"}
    w = MetricWriter(str(wd), log_cfg("jsonl", "tensorboard", *_available_extras()),
                     is_primary=True, run_name="secret-run")
    w.write_hparams(config)
    w.write_text(0, "config", f"{config} with key sk-test-123abc")
    w.write_scalars(1, {"train/loss": 1.0})
    w.close()
    stream = io.StringIO()
    p = Progress(10, start_step=0, is_primary=True, stream=stream)
    p.message("connecting to postgres://bob:hunter2@db/x with sk-test-123abc")
    p.update(1, {"train/loss": 1.0, "train/lr": 1e-3})
    p.close()
    captured = capsys.readouterr()
    texts = [stream.getvalue(), captured.out, captured.err]
    assert "<redacted>" in stream.getvalue()
    files = [p for p in wd.rglob("*") if p.is_file()]
    assert files
    for path in files:
        texts.append(path.read_bytes().decode("latin-1"))
    for text in texts:
        for secret in SECRETS:
            assert secret not in text


def test_mlflow_params_metrics_and_resume(tmp_path):
    from mlflow.tracking import MlflowClient
    wd = str(tmp_path)
    w = MetricWriter(wd, log_cfg("jsonl", "mlflow"), is_primary=True, run_name="r1")
    w.write_hparams({"optim": {"lr": 0.1}, "log": {"api_key": "s3cr3t-value"}})
    w.write_scalars(1, {"train/loss": 2.0, "train/nan": float("nan")})
    w.write_text(1, "notes/a", "hello")
    w.close()
    ids = w.run_ids()
    run_id = ids["mlflow"]
    w = MetricWriter(wd, log_cfg("jsonl", "mlflow"), is_primary=True, run_ids=ids)
    assert w.run_ids()["mlflow"] == run_id
    w.write_hparams({"optim": {"lr": 0.2, "warmup": 5}})
    w.write_scalars(2, {"train/loss": 1.0})
    w.close()
    client = MlflowClient(
        tracking_uri="sqlite:///" + os.path.join(os.path.abspath(wd), "mlflow.db"))
    run = client.get_run(run_id)
    assert run.data.params == {"optim.lr": "0.1", "log.api_key": "<redacted>", "optim.warmup": "5"}
    assert run.data.tags["jtrain.changed_param.optim.lr"] == "0.2"
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 2.0), (2, 1.0)]
    assert len(client.search_runs([run.info.experiment_id])) == 1
    assert glob.glob(os.path.join(wd, "mlartifacts", "**", "step_00000001.txt"), recursive=True)


def test_wandb_offline_and_resume(tmp_path):
    wd = str(tmp_path)
    w = MetricWriter(wd, log_cfg("jsonl", "wandb"), is_primary=True, run_name="r1")
    w.write_hparams({"optim": {"lr": 0.1}})
    w.write_scalars(1, {"train/loss": 2.0})
    w.close()
    ids = w.run_ids()
    run_id = ids["wandb"]
    w = MetricWriter(wd, log_cfg("jsonl", "wandb"), is_primary=True, run_ids=ids)
    assert w.run_ids()["wandb"] == run_id
    w.write_scalars(2, {"train/loss": 1.0})
    w.close()
    files = sorted(glob.glob(os.path.join(wd, "wandb", "offline-run-*", f"run-{run_id}.wandb")))
    assert len(files) == 2  # two offline segments of the same run id; `wandb sync` joins them
    data = b"".join(open(f, "rb").read() for f in files)
    assert b"train/loss" in data and b"optim" in data
