"""Every entry point as a user runs it: `python -m ...` in a subprocess from a fresh
directory with relative paths, no conftest help. One line and an exit code for every
mistake; `--help` exits 0. The table of mistakes per command (missing runs, missing
--out, unknown benchmarks, ...) is tests/bad_input/test_failure_table.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run(tmp_path, *args):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def test_unknown_flag_is_a_usage_error_everywhere(tmp_path):
    for args in (("jtrain.evaluate", "--workdir=x", "--bogus=1"),
                 ("jtrain.export", "x", "--out=y", "--bogus=1"),
                 ("jtrain.bench", "data", "--bogus=1")):
        proc = run(tmp_path, *args)
        assert proc.returncode == 2, args
        line = one_line(proc.stderr)
        assert line.startswith("jtrain: usage error:") and "bogus" in line, (args, line)


def _module_forms() -> list[list[str]]:
    """Every command's documented form after `python -m`: `jtrain.main`, ..., `jtrain trust`."""
    from jtrain.cli import COMMANDS

    return [c.prog.split()[2:] for c in COMMANDS.values()]


@pytest.mark.parametrize("form", _module_forms(), ids=" ".join)
def test_help_exits_0(tmp_path, form):
    """Every command takes --help, exit 0 (the README says so)."""
    proc = run(tmp_path, *form, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout, proc.stdout[:300]


def test_jtrain_console_script(tmp_path):
    """The installed `jtrain` script: its usage (exit 0 on --help) and a subcommand's
    --help (exit 0: the `python -m` form's flags behind it). Every subcommand's errors:
    tests/bad_input/test_failure_table.py; the whole journey (train, Ctrl-C, resume, evaluate,
    export, init_from) is tests/journeys/test_readme_commands.py."""
    jtrain = os.path.join(os.path.dirname(sys.executable), "jtrain")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def script(*args):
        return subprocess.run([jtrain, *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)

    proc = script("--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: jtrain {train,evaluate,"
                                                           "export,tune,bench,diff,replay,"
                                                           "trust,sample,tokenize}"), proc
    proc = script("train", "--help")
    assert proc.returncode == 0 and "--print_config" in proc.stdout and "--verbosity" in \
        proc.stdout, proc.stderr
