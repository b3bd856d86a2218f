"""End to end: what a run prints and writes (two processes, non-TTY), secrets, the eval
wiring (exact metrics through the jitted eval step), and `python -m jtrain.evaluate`."""

import io
import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn import metrics as skm

import jtrain
from jtrain import config as config_lib
from jtrain import evaluate
from jtrain.observe import perf, plots
from jtrain import metrics as M
from jtrain import mesh as mesh_lib
from jtrain.observe import console as progress
from jtrain import step as step_lib
from jtrain.observe.console import Progress

REPO = str(Path(__file__).resolve().parents[2])
SECRETS = {"WANDB_API_KEY": "sk-test-123abc", "HF_TOKEN": "hf_s3cr3t_value"}
URI_PASSWORD = "hunter2pw"
STEP_LINE = re.compile(r"^step \d+/\d+ \[")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_text(workdir: Path) -> list[tuple[str, str]]:
    return [(str(p), p.read_bytes().decode("latin-1")) for p in workdir.rglob("*") if p.is_file()]


def assert_no_secrets(texts):
    for where, text in texts:
        for secret in (*SECRETS.values(), URI_PASSWORD):
            assert secret not in text, f"{secret!r} found in {where}"


# ----------------------------------------------------------------------------------------
# Two processes on the CLI, output not a terminal


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("mp") / "run"
    env = dict(os.environ, JAX_PLATFORMS="cpu", **SECRETS,
               XLA_FLAGS="--xla_force_host_platform_device_count=1")  # jtrain as installed
    port = free_port()
    cmd = [sys.executable, "-m", "jtrain.main", "--config=configs/base.py:debug",
           f"--workdir={workdir}", "--config.total_steps=20", "--config.eval.every_steps=10",
           "--config.log.every_steps=5", "--config.checkpoint.every_steps=10",
           "--config.optim.warmup_steps=2", "--config.eval.num_batches=2",
           # auroc: host-side, so each process's rows are gathered across processes
           "--config.eval.metrics=('loss','accuracy','auroc')",
           f"--config.log.mlflow_tracking_uri=postgres://bob:{URI_PASSWORD}@db/x",
           f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2"]
    procs, outs = [], []
    try:
        for i in range(2):
            procs.append(subprocess.Popen(
                ["timeout", "-s", "KILL", "170", *cmd, f"--process_id={i}"], cwd=REPO, env=env,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                start_new_session=True))
        deadline = time.monotonic() + 180
        for p in procs:
            outs.append(p.communicate(timeout=max(deadline - time.monotonic(), 1)))
    finally:
        for p in procs:  # jax.distributed catches SIGTERM: SIGKILL the process group
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return workdir, procs, outs


def test_non_tty_one_line_per_log_step_and_quiet_other_process(two_process_run):
    workdir, procs, outs = two_process_run
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, (out + err)[-3000:]
    out0 = outs[0][0] + outs[0][1]
    steps = [ln for ln in out0.splitlines() if STEP_LINE.match(ln)]
    assert [int(ln.split()[1].split("/")[0]) for ln in steps] == [5, 10, 15, 20]
    assert "\r" not in out0
    assert "2 process(es)" in out0 and "batches per epoch" in out0
    assert "jtrain: eval sequence: loss, accuracy, auroc;" in out0
    assert len(re.findall(r"^jtrain: eval at step \d+ \(32 examples\)", out0, re.M)) == 2
    assert outs[1] == ("", ""), outs[1]  # process 1 prints nothing at all
    log = (workdir / progress.LOG_FILE).read_text()
    assert len([ln for ln in log.splitlines() if " step " in ln and "/20 [" in ln]) == 4
    assert "jtrain: done at step 20" in log


def test_no_secret_in_any_file_or_output(two_process_run):
    workdir, procs, outs = two_process_run
    assert procs[0].returncode == 0
    files = all_text(workdir)
    assert any(p.endswith(progress.LOG_FILE) for p, _ in files)
    assert any("<redacted>" in t for p, t in files if p.endswith("config.json"))
    assert_no_secrets(files + [("stdout/stderr", o + e) for o, e in outs])


def test_evaluate_cli_on_language_model_run(two_process_run, capsys):
    workdir, procs, _ = two_process_run
    assert procs[0].returncode == 0
    assert evaluate.main([f"--workdir={workdir}", "--step=latest", "--num_batches=2"]) == 0
    report = json.loads((workdir / "eval_20.json").read_text())
    assert report["task"] == "sequence" and report["num_examples"] == 32
    for key in ("eval/loss", "eval/accuracy", "eval/perplexity", "eval/bits_per_byte"):
        assert math.isfinite(report["metrics"][key]), key
    m = report["metrics"]
    assert math.isclose(m["eval/perplexity"], math.exp(m["eval/loss"]), rel_tol=1e-6)
    # The same checkpoint, evaluated during training on 2 processes x 1 device and here on
    # 1 process x 8 devices: the same numbers.
    logged = [r for r in evaluate.read_jsonl(str(workdir / "metrics.jsonl"))
              if r["step"] == 20 and "eval/loss" in r][-1]
    for key in ("eval/loss", "eval/accuracy"):
        assert math.isclose(m[key], logged[key], rel_tol=1e-6), key
    assert "eval/auroc" in logged  # computed from rows gathered across the 2 processes
    assert (workdir / "eval_20_curves.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "jtrain: eval of step 20 on eval (32 examples): loss" in out
    assert evaluate.main([f"--workdir={workdir}", "--step=7"]) == 2
    assert "no checkpoint at step 7" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------
# A classification run in-process: secrets, history, the evaluate command with plots


def blobs(n, seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n).astype(np.int32)
    centers = np.array([[0.0, 2.0], [2.0, -1.0], [-2.0, -1.0]], np.float32)
    x = (centers[y] + rng.normal(0, 0.9, (n, 2))).astype(np.float32)
    return x, y


@pytest.fixture(scope="module")
def classification_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("cls") / "run"
    x, y = blobs(600, 0)
    xe, ye = blobs(150, 1)  # 150: the last eval batch of 64 is padded
    old = {k: os.environ.get(k) for k in SECRETS}
    os.environ.update(SECRETS)
    cfg = {"model": {"name": "mlp", "num_outputs": 3, "hidden": (16,)}, "total_steps": 60,
           "data": {"batch_size": 32, "kwargs": {"api_key": "sk-test-123abc"}},
           "optim": {"lr": 0.02, "warmup_steps": 2}, "eval": {"every_steps": 20, "batch_size": 64},
           "log": {"every_steps": 20, "mlflow_tracking_uri": f"http://u:{URI_PASSWORD}@h/x"},
           "checkpoint": {"every_steps": 20}}
    out, err = io.StringIO(), io.StringIO()
    try:
        from contextlib import redirect_stderr, redirect_stdout
        with redirect_stdout(out), redirect_stderr(err):
            result = jtrain.train(cfg, str(workdir), train_data=(x, y), eval_data=(xe, ye))
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    np.savez(workdir.parent / "eval.npz", inputs=xe, targets=ye)
    return workdir, result, out.getvalue() + err.getvalue(), (xe, ye)


def test_classification_history_metrics_and_no_secrets(classification_run):
    workdir, result, output, _ = classification_run
    assert [h["step"] for h in result.history] == [20, 40, 60]
    last = result.history[-1]
    for key in ("eval/loss", "eval/accuracy", "eval/f1_macro", "eval/precision/2",
                "eval/auroc"):
        assert key in last, key
    assert last["eval/accuracy"] > 0.8 and last["eval/auroc"] > 0.9
    assert "eval classification: loss, accuracy, precision_recall_f1" in output
    assert_no_secrets(all_text(workdir) + [("output", output)])


def test_evaluate_cli_writes_json_and_pngs(classification_run, capsys):
    workdir, result, _, (xe, ye) = classification_run
    data = str(workdir.parent / "eval.npz")
    assert evaluate.main([f"--workdir={workdir}", "--step=best", f"--data={data}"]) == 0
    capsys.readouterr()
    best = min(result.history, key=lambda h: h["eval/loss"])["step"]
    report = json.loads((workdir / f"eval_{best}.json").read_text())
    assert report["step"] == best and report["num_examples"] == 150
    cm = np.array(report["confusion_matrix"])
    assert cm.shape == (3, 3) and cm.sum() == 150
    history = {h["step"]: h for h in result.history}
    assert math.isclose(report["metrics"]["eval/accuracy"], history[best]["eval/accuracy"],
                        rel_tol=1e-6)
    assert math.isclose(report["metrics"]["eval/accuracy"], np.trace(cm) / 150, rel_tol=1e-9)
    assert set(report["files"]) == {f"eval_{best}.json", f"eval_{best}_curves.png",
                                    f"eval_{best}_confusion.png", "goodput.png"}
    for name in report["files"][1:]:
        assert (workdir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------------------
# The eval step and loop: exact metrics over padded batches on 8 devices


def linear_apply(params, x, rng=None, train=False):
    return x @ params["w"] + params["b"]


@pytest.mark.multidevice
@pytest.mark.parametrize("n,batch", [(203, 32), (64, 64)])
def test_eval_loop_exact_on_mesh(n, batch):
    assert jax.device_count() == 8
    rng = np.random.default_rng(n)
    c = 4
    params = {"w": jnp.asarray(rng.normal(size=(6, c)), jnp.float32), "b": jnp.zeros(c)}
    x = rng.normal(size=(n, 6)).astype(np.float32)
    y = rng.integers(0, c, n).astype(np.int32)
    cfg = config_lib.resolve({"eval": {"metrics": ["loss", "accuracy", "top_k_accuracy",
                                                   "precision_recall_f1", "confusion_matrix",
                                                   "auroc"], "top_k": 2}})
    spec = evaluate.make_spec(cfg.eval, linear_apply, params,
                              jax.ShapeDtypeStruct((batch, 6), jnp.float32),
                              {"targets": y[0]})
    mesh = mesh_lib.make_mesh(cfg.mesh)
    step = jax.jit(step_lib.make_eval_step(linear_apply, jtrain.losses.default_loss,
                                           user_loss=False, metrics=spec),
                   out_shardings=(mesh_lib.replicated(mesh), mesh_lib.batch_sharding(mesh),
                                  mesh_lib.replicated(mesh)))
    source = jtrain.data.as_data((x, y), "eval")
    result = evaluate.run_eval(step, params, source, mesh=mesh, local_batch=batch, spec=spec)
    logits = x.astype(np.float64) @ np.asarray(params["w"], np.float64)
    pred = logits.argmax(-1)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    s = result.scalars
    assert result.num_examples == n
    assert math.isclose(s["eval/loss"], skm.log_loss(y, probs, labels=range(c)), rel_tol=1e-5)
    assert math.isclose(s["eval/accuracy"], skm.accuracy_score(y, pred), rel_tol=1e-9)
    assert math.isclose(s["eval/top_2_accuracy"],
                        skm.top_k_accuracy_score(y, logits, k=2, labels=range(c)), rel_tol=1e-9)
    assert math.isclose(s["eval/f1_macro"], skm.f1_score(y, pred, average="macro"), rel_tol=1e-9)
    assert math.isclose(s["eval/auroc"], skm.roc_auc_score(y, probs, multi_class="ovr"),
                        rel_tol=1e-6)
    np.testing.assert_array_equal(result.arrays["confusion_matrix"],
                                  skm.confusion_matrix(y, pred, labels=range(c)))
    assert evaluate.format_line(5, result).startswith(
        f"jtrain: eval at step 5 ({n} examples): loss ")


def test_regression_eval_step_with_user_loss_and_spearman():
    rng = np.random.default_rng(3)
    n = 77
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]]) + rng.normal(0, 0.3, (n, 1))).astype(np.float32)
    params = {"w": jnp.ones((3, 1)), "b": jnp.zeros(1)}
    cfg = config_lib.resolve({})
    spec = evaluate.make_spec(cfg.eval, linear_apply, params,
                              jax.ShapeDtypeStruct((16, 3), jnp.float32), {"targets": y[0]})
    assert spec.task == "regression" and "spearman" in spec.names and spec.gathers

    def mean_loss(out, batch):  # a user loss returning a mean: exact under padding anyway
        return jnp.mean((out - batch["targets"]) ** 2)

    mesh = mesh_lib.make_mesh(cfg.mesh)
    step = jax.jit(step_lib.make_eval_step(linear_apply, mean_loss, user_loss=True,
                                           metrics=spec))
    source = jtrain.data.as_data({"inputs": x, "targets": y}, "eval")
    s = evaluate.run_eval(step, params, source, mesh=mesh, local_batch=16, spec=spec).scalars
    pred = (x @ np.ones((3, 1))).ravel()
    from scipy import stats
    assert math.isclose(s["eval/mse"], skm.mean_squared_error(y.ravel(), pred), rel_tol=1e-5)
    assert math.isclose(s["eval/loss"], s["eval/mse"], rel_tol=1e-5)
    assert math.isclose(s["eval/r2"], skm.r2_score(y.ravel(), pred), rel_tol=1e-5)
    assert math.isclose(s["eval/spearman"], stats.spearmanr(pred, y.ravel()).statistic,
                        rel_tol=1e-9)


def test_eval_spec_tasks_defaults_and_errors():
    spec = M.EvalSpec.create((64, 256), (64,), np.int32, byte_level=True)
    assert spec.task == "sequence" and spec.num_classes == 256
    assert spec.names == ("loss", "accuracy", "perplexity", "bits_per_byte")
    spec = M.EvalSpec.create((1000,), (), np.int64)
    assert spec.task == "classification" and "confusion_matrix" not in spec.names
    assert "top_5_accuracy" in M.make_collection(spec).metrics
    assert M.EvalSpec.create((2,), (), np.int32).names == (
        "loss", "accuracy", "precision_recall_f1", "confusion_matrix", "auroc")
    assert M.EvalSpec.create(None, (), np.int32).names == ("loss",)
    with pytest.raises(config_lib.ConfigError, match=r"^eval\.metrics: mse cannot be computed"):
        M.EvalSpec.create((10,), (), np.int32, names=("accuracy", "mse"))


def test_resolve_step(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 10, "eval/loss": 2.0}\n{"step": 20, "eval/loss": 1.0}\n'
        '{"step": 30, "eval/loss": 1.5}\n{"step": 30, "train/lo')  # a torn last line
    assert evaluate.resolve_step("latest", [10, 20, 30], str(tmp_path)) == 30
    assert evaluate.resolve_step("best", [10, 20, 30], str(tmp_path)) == 20
    assert evaluate.resolve_step("best", [10, 30], str(tmp_path)) == 30
    assert evaluate.resolve_step("best", [10, 20, 30], str(tmp_path), mode="max") == 10
    assert evaluate.resolve_step("20", [10, 20], str(tmp_path)) == 20
    with pytest.raises(ValueError, match="no checkpoint at step 5"):
        evaluate.resolve_step(5, [10], str(tmp_path))
    with pytest.raises(FileNotFoundError):
        evaluate.resolve_step("latest", [], str(tmp_path))


# ----------------------------------------------------------------------------------------
# Console and log file


def test_verbosity_log_file_and_deduplicated_warnings(tmp_path):
    log = tmp_path / "train.log"
    out = io.StringIO()
    p = Progress(10, start_step=0, is_primary=True, stream=out, verbosity=0, log_path=str(log))
    p.message("header")                     # level 1: file only at verbosity 0
    p.message("debug table", level=2)       # level 2: nowhere
    p.update(5, {"train/loss": 1.0, "train/skipped_steps": 0.0})
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # Python itself would show it once per location
        for _ in range(3):
            warnings.warn("disk almost full", UserWarning, stacklevel=1)  # from this line
    logging.getLogger("jtrain").warning("checkpoint 7 does not restore")
    logging.getLogger("jtrain").warning("checkpoint 7 does not restore")
    p.message("jtrain: done", level=0)
    p.close()
    assert out.getvalue() == "jtrain: done\n"
    text = log.read_text()
    lines = [ln.split(" ", 2)[2] for ln in text.splitlines()]
    assert lines[0] == "header"
    assert lines[1].startswith("step 5/10 [##########----------] 50% | loss 1 | ema 1 | ")
    assert "debug table" not in text
    assert sum("disk almost full" in ln for ln in lines) == 2  # once, plus "repeated 3 times"
    assert "jtrain: warning repeated 3 times: UserWarning: disk almost full" in lines
    assert sum("does not restore" in ln for ln in lines) == 2
    # Hooks are released on close.
    assert warnings.showwarning is not None and logging.getLogger("jtrain").handlers == []


def test_all_hosts_prefix_and_quiet_warnings(tmp_path):
    out = io.StringIO()
    p = Progress(10, start_step=0, is_primary=False, stream=out, all_hosts=True,
                 process_index=1, log_path=str(tmp_path / "x.log"))
    p.message("hello")
    p.update(2, {"train/loss": 2.0, "train/skipped_steps": 3.0, "perf/mfu": 0.25,
                 "perf/steps_per_sec": 4.0})
    p.close()
    assert not (tmp_path / "x.log").exists()  # only process 0 writes the log file
    lines = out.getvalue().splitlines()
    assert lines[0] == "[process 1] hello"
    assert lines[1].startswith("[process 1] step 2/10") and "skipped_steps 3" in lines[1]
    assert "4.0 steps/s | mfu 25.0%" in lines[1]
    quiet = io.StringIO()
    p = Progress(10, start_step=0, is_primary=False, stream=quiet)
    warnings.warn("from process 1", stacklevel=1)
    logging.getLogger("jtrain").warning("from process 1")
    p.close()
    assert quiet.getvalue() == ""


def test_epoch_and_batch_at_boundaries():
    out = io.StringIO()
    p = Progress(100, start_step=0, is_primary=True, stream=out, batches_per_epoch=10)
    p.update(10, {"train/loss": 1.0})
    p.update(11, {"train/loss": 1.0})
    assert "epoch 0 batch 10/10" in out.getvalue().splitlines()[0]
    assert "epoch 1 batch 1/10" in out.getvalue().splitlines()[1]


# ----------------------------------------------------------------------------------------
# Performance metrics and the profiler


def test_peak_flops_and_meter(monkeypatch):
    class Dev:
        platform, device_kind = "gpu", "NVIDIA H100 80GB HBM3"
    assert perf.peak_flops_per_device(0.0, Dev()) == 989e12
    assert perf.peak_flops_per_device(5e12, Dev()) == 5e12
    assert perf.peak_flops_per_device(0.0, jax.devices()[0]) is None  # cpu
    clock = iter([0.0, 2.0, 2.5, 3.0, 4.0, 8.5, 9.0, 9.1, 9.2])
    monkeypatch.setattr(perf.time, "perf_counter", lambda: next(clock))
    m = perf.Meter(start_step=0, global_batch=8, flops_per_example=1e9, peak_flops=1e11,
                   num_devices=2, t_start=0.0)                       # reads 0.0
    m.step_done(1, 0.5, 1.5, metrics=jnp.zeros(()))                  # 2.0 first step, mark 2.5
    m.step_done(10, 0.5, 0.1)                                        # dispatched at 3.0
    v = m.log_values(10, tokens=80.0)  # fetched at 4.0: the longer interval (fetches) counts
    assert v["perf/steps_per_sec"] == 2.5 and v["perf/examples_per_sec"] == 20.0
    assert v["perf/tokens_per_sec"] == 200.0 and v["perf/data_wait_frac"] == 0.25
    assert math.isclose(v["perf/mfu"], 1e9 * 20.0 / 2e11)
    assert v["perf/compile_sec"] == 1.5 and v["perf/time_to_first_step_sec"] == 2.0
    m.add("eval", 3.0)                                               # evaluation at step 10
    m.step_done(15, 0.0, 0.1)                                        # dispatched at 8.5
    m.step_done(20, 0.0, 0.1)                                        # dispatched at 9.0
    v15, v20 = m.log_values(15, 80.0), m.log_values(20, 80.0)       # fetched at 9.1, 9.2
    # Drained back to back at the end: the dispatch intervals count; eval time left out.
    assert v15["perf/steps_per_sec"] == 2.0 and v20["perf/steps_per_sec"] == 10.0
    assert "perf/compile_sec" not in v20
    assert m.summary()["perf/steps_per_sec"] == 10 / 3  # the first interval (compile) left out
    assert "eval 3.00s" in m.debug_line()


def test_model_flops_declared_by_user_model():
    class Model:
        def flops_per_example(self, shape):
            return 6.0 * shape[0]
    from jtrain.engine.assemble import model_flops_per_example

    assert model_flops_per_example(Model(), None, (4,)) == 24.0
    assert model_flops_per_example(object(), None, (4,)) is None
    cfg = config_lib.defaults("transformer").model
    assert model_flops_per_example(None, cfg, (cfg.max_len,)) > 0


def test_profiler_writes_a_trace(tmp_path):
    cfg = config_lib.defaults().profile
    cfg.start_step, cfg.num_steps = 2, 2
    prof = perf.Profiler(cfg, str(tmp_path), is_primary=True)
    f = jax.jit(lambda x: x @ x)
    x = jnp.ones((32, 32))
    stopped = []
    for step in range(1, 5):
        prof.before_step(step)
        stopped.append(prof.after_step(step, f(x)))
    assert stopped == [False, False, True, False]
    assert list((tmp_path / "profile").rglob("*.xplane.pb"))
    assert not perf.Profiler(cfg, str(tmp_path / "b"), is_primary=False)._on


def test_confusion_matrix_plot(tmp_path):
    plots.confusion_matrix(np.array([[5, 1], [0, 7]]), str(tmp_path / "cm.png"))
    assert (tmp_path / "cm.png").read_bytes()[:4] == b"\x89PNG"
    assert not plots.training_curves([{"step": 1, "eval/loss": 1.0}], str(tmp_path / "c.png"))
