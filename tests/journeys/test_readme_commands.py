"""The README's end-to-end block ("The commands, end to end"), run as a user types it:
the installed `jtrain` console script, from a fresh directory holding only `configs/`,
relative paths, no conftest help.

The block is read from README.md (between the `readme-commands` markers), so the README
and this test cannot drift apart. To stay fast, every `jtrain train` line gets the same
short-run overrides appended (SHORT) and `jtrain evaluate` gets `--num_batches=2`; the
commands are otherwise exactly the README's. The first line is stopped with SIGINT
(Ctrl-C) by the test once training has logged a step; the second (the same command)
must continue from the saved step to the end; evaluate, export and the init_from
fine-tune must then work from those relative paths. The commands share a persistent
JAX compilation cache (environment only; the same model compiles once, not four times).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from journey import user_env

REPO = Path(__file__).resolve().parents[2]
TOTAL = 24
SHORT = [f"--config.total_steps={TOTAL}", "--config.optim.warmup_steps=2",
         "--config.log.every_steps=1", "--config.eval.every_steps=12",
         "--config.eval.num_batches=1", "--config.checkpoint.every_steps=12"]


def readme_commands() -> list[list[str]]:
    text = (REPO / "README.md").read_text()
    block = re.search(r"<!-- readme-commands.*?```bash\n(.*?)```", text, re.DOTALL)
    assert block, "README.md lost its readme-commands block"
    return [shlex.split(line, comments=True) for line in block.group(1).splitlines()
            if line.strip()]


def _jtrain() -> str:
    return str(Path(sys.executable).with_name("jtrain"))


def _argv(cmd: list[str]) -> list[str]:
    assert cmd[0] == "jtrain", cmd
    extra = SHORT if cmd[1] == "train" else ["--num_batches=2"] if cmd[1] == "evaluate" else []
    return [_jtrain(), *cmd[1:], *extra]


def _env(cwd) -> dict:
    return user_env(JAX_COMPILATION_CACHE_DIR=str(Path(cwd, ".jax_cache")),
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def _run(cwd, cmd) -> subprocess.CompletedProcess:
    proc = subprocess.run(_argv(cmd), cwd=cwd, env=_env(cwd), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, (cmd, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr[-3000:]
    return proc


def _interrupt(cwd, cmd) -> subprocess.CompletedProcess:
    """Starts `cmd`, sends SIGINT once metrics.jsonl has a train step, waits."""
    workdir = Path(cwd, next(a.split("=", 1)[1] for a in cmd if a.startswith("--workdir=")))
    proc = subprocess.Popen(_argv(cmd), cwd=cwd, env=_env(cwd), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        log = workdir / "metrics.jsonl"
        if log.exists() and '"train/loss"' in log.read_text():
            proc.send_signal(signal.SIGINT)
            break
        time.sleep(0.05)
    out, err = proc.communicate(timeout=240)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_readme_commands_as_typed(tmp_path):
    assert Path(_jtrain()).exists(), "the jtrain console script: pip install -e ."
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    cmds = readme_commands()
    assert [c[1] for c in cmds] == ["train", "train", "evaluate", "export", "train"]
    assert cmds[0] == cmds[1]  # Ctrl-C, then the same command

    stopped = _interrupt(tmp_path, cmds[0])
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr
    first = json.loads((tmp_path / "runs/debug/summary.json").read_text())
    assert first["stopped_by"] == "SIGINT" and 0 < first["step"] < TOTAL, first

    resumed = _run(tmp_path, cmds[1])
    result = json.loads(resumed.stdout.strip().splitlines()[-1])  # the result on stdout
    assert result["step"] == TOTAL and result["resumed_from"] == first["step"], result
    assert "eval/loss" in result

    evaluated = _run(tmp_path, cmds[2])
    assert evaluated.stdout.startswith("jtrain: eval of step "), evaluated.stdout
    assert list((tmp_path / "runs/debug").glob("eval_*.json"))

    exported = _run(tmp_path, cmds[3])
    assert exported.stdout.startswith(f"jtrain: exported step {TOTAL}:"), exported.stdout
    assert (tmp_path / "exports/debug/params.safetensors").is_file()

    tuned = _run(tmp_path, cmds[4])
    assert "initialized from exports/debug" in tuned.stderr, tuned.stderr[-3000:]
    assert json.loads(tuned.stdout.strip().splitlines()[-1])["step"] == TOTAL
    assert not os.path.exists(tmp_path / "runs/ft/checkpoints.damaged")


def test_the_getting_started_first_run_is_the_readme_blocks_first_line():
    """docs/guide/getting-started.md's first run is the command this test's journey runs
    first (the README block's first line, without its comment)."""
    first = shlex.join(readme_commands()[0])
    page = (REPO / "docs" / "guide" / "getting-started.md").read_text()
    block = re.search(r"<!-- tested: tests/journeys/test_readme_commands.py -->\n```bash\n(.*?)```",
                      page, re.S)
    assert block and block.group(1).strip() == first, (first, block and block.group(1))
