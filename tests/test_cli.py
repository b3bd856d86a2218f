"""Every entry point as a user runs it: `python -m ...` in a subprocess from a fresh
directory with relative paths, no conftest help. One line and an exit code for every
mistake; `--help` exits 0."""

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


def test_export_of_a_missing_run_is_one_line_exit_3(tmp_path):
    proc = run(tmp_path, "jtrain.export", "runs/nope", "--out=exports/x")
    assert proc.returncode == 3
    assert one_line(proc.stderr).startswith("jtrain: export error: runs/nope")
    assert not (tmp_path / "exports").exists()  # nothing written for a failed export


def test_export_without_out_is_a_usage_error(tmp_path):
    proc = run(tmp_path, "jtrain.export", "runs/nope")
    assert proc.returncode == 2
    assert one_line(proc.stderr) == "jtrain: usage error: --out: required (the export directory)"


def test_evaluate_of_a_missing_run_is_one_line(tmp_path):
    proc = run(tmp_path, "jtrain.evaluate", "--workdir=runs/nope")
    assert proc.returncode == 2
    assert one_line(proc.stderr).startswith("jtrain: evaluate error: --workdir:")


def test_unknown_flag_is_a_usage_error_everywhere(tmp_path):
    for args in (("jtrain.evaluate", "--workdir=x", "--bogus=1"),
                 ("jtrain.export", "x", "--out=y", "--bogus=1"),
                 ("jtrain.bench", "data", "--bogus=1")):
        proc = run(tmp_path, *args)
        assert proc.returncode == 2, args
        line = one_line(proc.stderr)
        assert line.startswith("jtrain: usage error:") and "bogus" in line, (args, line)


def test_unknown_benchmark_is_one_line_exit_2(tmp_path):
    proc = run(tmp_path, "jtrain.bench", "nosuch")
    assert proc.returncode == 2
    assert "unknown benchmark 'nosuch'" in one_line(proc.stderr)


@pytest.mark.parametrize("module", ["jtrain.main", "jtrain.evaluate", "jtrain.export",
                                    "jtrain.bench"])
def test_help_exits_0(tmp_path, module):
    proc = run(tmp_path, module, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout
