"""Run control as a user meets it: the CLI and a plain script, each in a subprocess from a
temp cwd with relative paths and no test helpers: a user's data module with overflowing
rows (skipped, ledger; `nonfinite.policy=halt` exits 4 with one line; most updates
skipped by missing inputs: exit 4, not done, checkpoints kept), early stopping on
a threshold, a mistyped monitor and an impossible memory budget (exit 2, one line), a
user's NNX model stopped by `on_eval` with a plateau, and two processes where only one
holds the bad rows (both skip the same step; nothing hangs)."""

import json
import os
import socket
import subprocess
import sys

from journey import copy_project

CONFIG_FILE = '''
from jtrain.config import defaults

def get_config():
    config = defaults(model="mlp")
    config.update({"model": {"num_outputs": 2, "hidden": (16,)},
                   "data": {"source": "tabular:make", "batch_size": 8, "shuffle": False},
                   "optim": {"name": "sgd", "lr": 0.1, "schedule": "constant"},
                   "total_steps": 8, "eval": {"every_steps": 4}, "log": {"every_steps": 1}})
    return config
'''

CLI = ["--config=myconfig.py"]


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "XLA_FLAGS", "JTRAIN_FAULT")}
    env.update(JAX_PLATFORMS="cpu", **extra)
    return env


def _cwd(tmp_path):
    copy_project(tmp_path, "tabular")
    (tmp_path / "myconfig.py").write_text(CONFIG_FILE)
    return tmp_path


def _cli(cwd, *args, env=None):
    return subprocess.run([sys.executable, "-m", "jtrain.main", *CLI, *args], cwd=cwd,
                          env=env or _env(), capture_output=True, text=True, timeout=300)


def _errors(stderr):
    return [ln for ln in stderr.splitlines() if " error: " in ln]


def test_cli_bad_rows_skip_then_halt_and_early_stop(tmp_path):
    cwd = _cwd(tmp_path)
    bad = "--config.data.kwargs={'bad': (8, 9)}"  # batch 2 (rows 8..15) overflows
    # skip (the default): the run goes on, the ledger names step 2 and its examples;
    # with a NaN input in 2 more batches (3 of 8 skipped, below
    # nonfinite.max_skipped_share=0.5) it ends done, exit 0.
    proc = _cli(cwd, "--workdir=runs/skip",
                "--config.data.kwargs={'bad': (8, 9), 'missing': (17, 25)}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stderr.rstrip().splitlines()[-1]
    assert last.startswith("jtrain: done at step 8") and last.endswith("; 3 skipped steps")
    summary = json.load(open(cwd / "runs/skip/summary.json"))
    assert (summary["stopped_by"], summary["exit_code"]) == (None, 0)
    ledger = [json.loads(ln) for ln in open(cwd / "runs/skip/skipped.jsonl")]
    assert [(e["step"], e["reason"], e["examples"]) for e in ledger] == [
        (2, "non-finite loss", list(range(8, 16))), (3, "invalid batch", [17]),
        (4, "invalid batch", [25])]
    # halt: exit 4, one line, no traceback; what was saved before stays.
    proc = _cli(cwd, "--workdir=runs/halt", bad, "--config.nonfinite.policy=halt",
                "--config.checkpoint.every_steps=1")
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert _errors(proc.stderr) == [
        ln for ln in proc.stderr.splitlines() if ln.startswith("jtrain: non-finite error:")]
    assert len(_errors(proc.stderr)) == 1 and "halted at step 2" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert os.listdir(cwd / "runs/halt/checkpoints") == ["1"]
    # ...and that line in summary.json (with the exit code) and train.log.
    halt_line = _errors(proc.stderr)[0]
    summary = json.load(open(cwd / "runs/halt/summary.json"))
    assert (summary["stopped_by"], summary["step"], summary["exit_code"],
            summary["message"], summary["checkpoint_step"]) == \
        ("non-finite", 2, 4, halt_line, 1)
    assert (cwd / "runs/halt/train.log").read_text().splitlines()[-1].endswith(
        " " + halt_line)
    # early stopping on a threshold: one line, exit 0, the reason in summary.json.
    proc = _cli(cwd, "--workdir=runs/es", "--config.early_stop.monitor=eval/accuracy",
                "--config.early_stop.mode=max", "--config.early_stop.stopping_threshold=0.01")
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stderr.rstrip().splitlines()[-1]  # the final line says it stopped early
    assert last.startswith("jtrain: stopped early at step 4 by early_stop: eval/accuracy ")
    assert "; checkpoint saved; eval loss " in last and "done" not in proc.stderr
    summary = json.load(open(cwd / "runs/es/summary.json"))
    assert (summary["stopped_by"], summary["step"]) == ("early_stop", 4)
    assert (summary["message"], summary["exit_code"]) == (last, 0)
    assert (cwd / "runs/es/train.log").read_text().splitlines()[-1].endswith(" " + last)
    assert summary["best_metric"] == "eval/accuracy" and summary["best_step"] == 4


def test_cli_most_updates_skipped_is_not_done(tmp_path):
    """Rows with a NaN input in 6 of the 8 batches (each skipped with a warning): the run
    reaches step 8 with 2 updates applied, more than nonfinite.max_skipped_share (0.5)
    skipped: one error line, exit 4, summary.json not done, its checkpoints kept. (Below
    the share it ends done, exit 0: test_cli_bad_rows_skip_then_halt_and_early_stop.)"""
    cwd = _cwd(tmp_path)
    many = "--config.data.kwargs={'missing': (17, 25, 33, 41, 49, 57)}"  # not in eval's 16
    proc = _cli(cwd, "--workdir=runs/many", many, "--config.checkpoint.every_steps=4")
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    line = ("jtrain: non-finite error: 6 of 8 updates were skipped (75%), more than "
            "nonfinite.max_skipped_share=0.5: not done; the steps, reasons and examples are "
            "in WORKDIR/skipped.jsonl: fix the data (or raise nonfinite.max_skipped_share, "
            "1 = off); checkpoints kept")
    assert _errors(proc.stderr) == [line]
    assert proc.stderr.rstrip().splitlines()[-1] == line and "done at step" not in proc.stderr
    summary = json.load(open(cwd / "runs/many/summary.json"))
    assert (summary["stopped_by"], summary["step"], summary["skipped_steps"],
            summary["exit_code"], summary["message"]) == ("max_skipped_share", 8, 6, 4, line)
    assert "eval/loss" in summary  # the full summary: the final eval is there
    assert sorted(os.listdir(cwd / "runs/many/checkpoints")) == ["4", "8"]
    ledger = [json.loads(ln) for ln in open(cwd / "runs/many/skipped.jsonl")]
    assert [(e["step"], e["reason"], e["examples"]) for e in ledger] == [
        (s, "invalid batch", [8 * s - 7]) for s in range(3, 9)]
    assert (cwd / "runs/many/train.log").read_text().splitlines()[-1].endswith(" " + line)
    # Rerun: judged again (not "already finished"); a higher share: done, exit 0.
    proc = _cli(cwd, "--workdir=runs/many", many, "--config.checkpoint.every_steps=4")
    assert proc.returncode == 4 and _errors(proc.stderr) == [line], proc.stderr[-3000:]
    proc = _cli(cwd, "--workdir=runs/many", many, "--config.checkpoint.every_steps=4",
                "--config.nonfinite.max_skipped_share=0.8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.load(open(cwd / "runs/many/summary.json"))["stopped_by"] is None


def test_cli_loss_spike_rolls_back(tmp_path):
    cwd = _cwd(tmp_path)
    proc = _cli(cwd, "--workdir=runs/spike", "--config.total_steps=24",
                "--config.data.kwargs={'n': 192, 'spike': (104, 112)}",  # step 14
                "--config.eval.every_steps=0", "--config.checkpoint.every_steps=5",
                "--config.spike.zscore=6", "--config.spike.window=5",
                "--config.determinism.gpu_ops=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "jtrain: deterministic: on (CPU: already deterministic)" in proc.stderr
    line = [ln for ln in proc.stderr.splitlines() if "train loss spike" in ln]
    assert len(line) == 1 and line[0].startswith("jtrain: warning: step 14: train loss "
                                                 "spike") and "rolled back to step 10" in line[0]
    summary = json.load(open(cwd / "runs/spike/summary.json"))
    assert summary["rollbacks"] == [[14, 10]] and summary["step"] == 24


def test_cli_config_mistakes_are_one_line_exit_2(tmp_path):
    cwd = _cwd(tmp_path)
    for args, key in [(["--config.early_stop.monitor=eval/acuracy"], "early_stop.monitor"),
                      (["--config.memory.budget_bytes=1000"], "memory.budget_bytes")]:
        proc = _cli(cwd, "--workdir=runs/bad", *args)
        assert proc.returncode == 2, proc.stderr[-3000:]
        lines = _errors(proc.stderr)
        assert len(lines) == 1 and lines[0].startswith(f"jtrain: config error: {key}:"), \
            proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
        assert not (cwd / "runs/bad/checkpoints").exists() or \
            os.listdir(cwd / "runs/bad/checkpoints") == []
        if key == "early_stop.monitor":
            assert 'did you mean "eval/accuracy"' in lines[0]


SCRIPT = '''
import numpy as np
from flax import nnx
import jtrain
from nnx_mlp import Model  # the user's own module

r = np.random.default_rng(0)
x = r.normal(size=(96, 4)).astype(np.float32)
data = {"inputs": x, "targets": (x[:, 0] > 0).astype(np.int32)}
seen = []

def on_eval(step, metrics):
    seen.append(step)
    return step >= 6  # a research rule: stop at the third evaluation

config = {"total_steps": 40, "data": {"batch_size": 8},
          "optim": {"name": "sgd", "lr": 0.1, "schedule": "constant"},
          "eval": {"every_steps": 2}, "log": {"verbosity": 0, "every_steps": 1},
          "plateau": {"monitor": "eval/loss", "patience": 0, "min_delta": 10.0}}
result = jtrain.train(config, "runs/nnx", model=Model(nnx.Rngs(0)), train_data=data,
                      on_eval=on_eval)
print("evals", seen, "stopped_by", result.summary["stopped_by"],
      "lr_factor", round(result.summary["lr_factor"], 6))
'''


def test_script_nnx_model_on_eval_stop_and_plateau(tmp_path):
    copy_project(tmp_path, "nnx_mlp")
    (tmp_path / "train_nnx.py").write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "train_nnx.py"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # min_delta 10 means no eval ever improves: with patience 0 every eval after the
    # first multiplies the rate by 0.1 (steps 4 and 6).
    assert "evals [2, 4, 6] stopped_by on_eval lr_factor 0.01" in proc.stdout
    summary = json.load(open(tmp_path / "runs/nnx/summary.json"))
    assert (summary["step"], summary["stopped_by"]) == (6, "on_eval")
    assert "6" in os.listdir(tmp_path / "runs/nnx/checkpoints")
    lrs = [json.loads(ln).get("train/lr") for ln in open(tmp_path / "runs/nnx/metrics.jsonl")]
    # the effective rate: 0.1 until the first reduction (after step 4's eval), then 0.01
    assert [round(v, 6) for v in lrs if v is not None] == [0.1] * 4 + [0.01] * 2


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_bad_rows_in_one_shard_skip_the_same_step(tmp_path):
    cwd = _cwd(tmp_path)
    env = _env(XLA_FLAGS="--xla_force_host_platform_device_count=1",
               JTRAIN_COORDINATOR=f"127.0.0.1:{_free_port()}", JTRAIN_NUM_PROCESSES="2")
    # process p reads rows [4p, 4p+4) of each global batch of 8: rows 13..15 of batch 2
    # are in process 1's shard only.
    args = ["--workdir=runs/two", "--config.data.kwargs={'bad': (13, 14, 15)}",
            "--config.checkpoint.every_steps=4"]
    procs = [subprocess.Popen(
        ["timeout", "-k", "5", "240", sys.executable, "-m", "jtrain.main", *CLI, *args],
        cwd=cwd, env={**env, "JTRAIN_PROCESS_ID": str(i)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate()[1] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]  # 124 would be a hang
    summary = json.load(open(cwd / "runs/two/summary.json"))
    assert summary["step"] == 8 and summary["skipped_steps"] == 1
    ledger = [json.loads(ln) for ln in open(cwd / "runs/two/skipped.jsonl")]
    assert [e["step"] for e in ledger] == [2]
