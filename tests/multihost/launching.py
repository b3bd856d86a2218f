"""Shared by the launcher tests: the repository's launch/ scripts, the fakes of srun,
scontrol and gcloud (tests/multihost/fake_bin), a tiny 2-process training config, and
helpers to run and signal launchers the way a user or a scheduler does."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch"
FAKE_BIN = Path(__file__).resolve().parent / "fake_bin"

# The debug transformer made smaller still: a step is mostly collective overhead.
TINY = ["--config=configs/base.py:debug", "--config.model.d_model=32",
        "--config.model.num_layers=1", "--config.model.d_ff=64", "--config.model.max_len=32",
        "--config.data.seq_len=32", "--config.data.batch_size=8", "--config.optim.warmup_steps=2",
        "--config.eval.every_steps=0", "--config.eval.num_batches=1",
        "--config.log.every_steps=1", "--config.log.writers=jsonl"]


def user_dir(tmp_path) -> Path:
    """A user's directory with the repo's configs/ (relative paths from here on)."""
    shutil.copytree(REPO / "configs", tmp_path / "configs",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def token_shards(cwd) -> int:
    """Byte-tokenized documents in shards of 1500 tokens under cwd/shards (for
    --config.data.name=tokens --config.data.path=shards); the number of shards."""
    from jtrain.data import tokenizer, tokens

    (cwd / "shards").mkdir()
    docs = [f"doc {i}: " + "the windows of a shard, shuffled per epoch. " * (3 + i % 5)
            for i in range(120)]
    index = tokens.write_shards(tokenizer.load("byte"), docs, str(cwd / "shards"), 1500)
    return len(index["shards"])


def env(**extra) -> dict:
    """A user's shell: the venv's python first on PATH, then the fakes; CPU JAX."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "XLA_FLAGS", "JTRAIN_FAULT", "JTRAIN_FAULT_PROCESS")}
    path = os.pathsep.join([os.path.dirname(sys.executable), str(FAKE_BIN), base["PATH"]])
    return {**base, "PATH": path, "JAX_PLATFORMS": "cpu", **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd, cwd, **extra) -> subprocess.Popen:
    return subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env(**extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def checkpoints(workdir: Path) -> list[int]:
    d = workdir / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


def wait_for_checkpoint_after(workdir: Path, step: int, proc: subprocess.Popen,
                              timeout: float = 240) -> int:
    """Polls until a checkpoint newer than `step` exists; the running launcher must not
    have ended meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        newer = [s for s in checkpoints(workdir) if s > step]
        if newer:
            return newer[-1]
        assert proc.poll() is None, f"ended early with {proc.returncode}: {proc.stderr.read()}"
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint after step {step} within {timeout} s")


def summary(workdir: Path) -> dict:
    return json.loads((workdir / "summary.json").read_text())


def term(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
