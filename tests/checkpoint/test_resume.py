"""Exact resume end to end: SIGTERM during eval / during a save (in-process), the CLI's
exit codes (0 after SIGTERM, 3 for strict / mismatched / changed-config restores), and a
resume on a different device count (saved on 2 fake devices, resumed on 8)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import jtrain
from jtrain.checkpoint import integrity
from jtrain import main as main_lib
from jtrain.control import faults

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOTAL = 40


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 16)).astype(np.float32)
    y = (x[:, :8].sum(1) > x[:, 8:].sum(1)).astype(np.int32)
    return (x[:448], y[:448]), (x[448:], y[448:])


def config(**over):
    cfg = {"seed": 0, "total_steps": TOTAL,
           "model": {"name": "mlp", "hidden": (32, 32), "num_outputs": 2, "dropout": 0.1},
           "data": {"batch_size": 16}, "optim": {"lr": 1e-2, "warmup_steps": 2,
                                                 "decay_steps": TOTAL},
           "eval": {"every_steps": 10, "num_batches": 2}, "checkpoint": {"every_steps": 10},
           "log": {"every_steps": 10, "writers": ("jsonl",)}}
    cfg.update(over)
    return cfg


def train(workdir, **over):
    train_data, eval_data = data()
    return jtrain.train(config(**over), str(workdir), train_data=train_data,
                        eval_data=eval_data)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("ref") / "run"
    return workdir, train(workdir).summary


@pytest.fixture
def fault(monkeypatch):
    monkeypatch.setattr(faults, "_fault_counts", {})

    def set_fault(spec):
        monkeypatch.setenv(faults.FAULT_ENV, spec)
        faults._fault_counts.clear()

    yield set_fault


@pytest.mark.slow  # seconds of CPU: the full suite runs it (tests/README.md)
def test_signals_save_current_step_and_resume_is_bitwise(reference, fault, tmp_path,
                                                         monkeypatch):
    """SIGTERM mid-save, SIGTERM mid-eval, SIGINT after a step (each the first of its
    kind in that process): each run stops with a finished checkpoint of the step it was
    at; three resumes end bitwise identical."""
    workdir = tmp_path / "run"
    last = 0
    for spec in ("save:1:TERM", "eval:1:TERM", "step:1:INT"):
        fault(spec)
        stopped = train(workdir).summary
        assert stopped["stopped_by"] == ("SIGINT" if spec.endswith("INT") else "SIGTERM")
        step = stopped["step"]
        assert last < step < TOTAL and stopped["resumed_from"] == (last or None), spec
        assert integrity.check_step(str(workdir / "checkpoints" / str(step)), step) is None
        last = step
    monkeypatch.delenv(faults.FAULT_ENV)
    resumed = train(workdir).summary
    assert resumed["resumed_from"] == last and resumed["stopped_by"] is None
    assert resumed["state_sha256"] == reference[1]["state_sha256"]


def run_cli(workdir, *extra, devices=1, env=None):
    env = dict(os.environ, JAX_PLATFORMS="cpu", **(env or {}),
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    cmd = [sys.executable, "-m", "jtrain.main", "--config=configs/base.py:debug",
           f"--workdir={workdir}", "--config.total_steps=20", "--config.eval.every_steps=10",
           "--config.eval.num_batches=2", "--config.checkpoint.every_steps=10",
           "--config.optim.decay_steps=20", "--config.model.d_model=32",
           "--config.model.num_layers=1", "--config.model.d_ff=64", *extra]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_cli_sigterm_exits_0_then_restore_errors_exit_3(tmp_path, capfd):
    workdir = tmp_path / "cli"
    proc = run_cli(workdir, env={faults.FAULT_ENV: "step:15:TERM"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "SIGTERM received" in proc.stderr
    with open(workdir / "summary.json") as f:
        summary = json.load(f)
    assert summary["stopped_by"] == "SIGTERM" and summary["step"] == 15
    assert sorted(os.listdir(workdir / "checkpoints")) == ["10", "15"]

    def cli_exit(*extra):  # in-process: fails before any training
        argv = ["jtrain", "--config=configs/base.py:debug", f"--workdir={workdir}",
                "--config.total_steps=20", "--config.eval.every_steps=10",
                "--config.eval.num_batches=2", "--config.checkpoint.every_steps=10",
                "--config.optim.decay_steps=20", "--config.model.d_model=32",
                "--config.model.num_layers=1", "--config.model.d_ff=64", *extra]
        cwd = os.getcwd()
        os.chdir(REPO)
        capfd.readouterr()
        try:
            with pytest.raises(SystemExit) as e:
                main_lib.cli(argv)
        finally:
            os.chdir(cwd)
        lines = [ln for ln in capfd.readouterr().err.splitlines() if "error:" in ln]
        assert len(lines) == 1, lines
        return e.value.code, lines[0]

    # A changed config: refused with the diff, exit 3.
    code, line = cli_exit("--config.optim.lr=0.1")
    assert code == 3 and "jtrain: restore error: the config changed" in line
    assert "optim.lr 0.003 -> 0.1" in line and "allow_changes=optim.lr" in line
    # Another model (allowed as a config change): the leaf and both shapes, exit 3.
    code, line = cli_exit("--config.model.d_ff=128", "--config.checkpoint.allow_changes=model.*")
    assert code == 3 and "does not fit the model: params/" in line
    assert "checkpoint has (32, 64) float32, the model (32, 128) float32" in line
    # A flipped byte in the newest checkpoint with --strict_restore: exit 3, nothing moved.
    state_dir = workdir / "checkpoints" / "15" / "state"
    blob = max((os.path.join(r, f) for r, _, fs in os.walk(state_dir) for f in fs),
               key=os.path.getsize)
    with open(blob, "r+b") as f:
        f.seek(os.path.getsize(blob) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    code, line = cli_exit("--strict_restore")
    assert code == 3 and "damaged checkpoint:" in line and "/15/state/" in line
    assert sorted(os.listdir(workdir / "checkpoints")) == ["10", "15"]


@pytest.mark.multidevice
def test_resume_on_more_devices_continues_the_data_order(reference, tmp_path):
    """Saved on 2 fake devices (a subprocess stopped by SIGTERM at step 20), resumed here
    on 8: parameters reshard, the batches continue where they stopped."""
    workdir = tmp_path / "run"
    script = (
        "import sys; sys.path.insert(0, %r); import jax\n"
        "import test_resume as t\n"
        "assert jax.device_count() == 2\n"
        "t.train(sys.argv[1])\n" % os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{faults.FAULT_ENV: "step:20:TERM"},
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, "-c", script, str(workdir)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "20" in os.listdir(workdir / "checkpoints")
    resumed = train(workdir).summary  # 8 devices here
    assert resumed["resumed_from"] == 20 and resumed["step"] == TOTAL
    from journey import metric_by_step  # here: a subprocess imports this file bare

    ref_losses, got = metric_by_step(reference[0]), metric_by_step(workdir)
    for step in (30, 40):  # after the resume: the same batches, to float reduction order
        np.testing.assert_allclose(got[step], ref_losses[step], rtol=1e-4)
    np.testing.assert_allclose(resumed["eval/loss"], reference[1]["eval/loss"], rtol=1e-4)
