"""The linter and the type checker, run with the tests: ruff over jtrain/ and tests/
(pyproject's [tool.ruff]: pyflakes, pycodestyle, bugbear) and mypy over the public API's
modules (pyproject's [tool.mypy]: `files`). Both come with `pip install -e '.[test]'`,
pinned, so a finding is the code's, never a new release's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: int) -> subprocess.CompletedProcess:
    """`python -m ARGS` from the checkout's root (where pyproject.toml configures both),
    its output as plain text (no colour codes in a failure's message)."""
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout,
                          env={**os.environ, "NO_COLOR": "1", "TERM": "dumb"})


def test_ruff_finds_nothing():
    proc = _run("ruff", "check", "jtrain", "tests", timeout=300)
    assert proc.returncode == 0, (
        f"ruff check jtrain tests (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")


def test_mypy_finds_nothing_in_the_public_api():
    # A cold run (a fresh checkout has no .mypy_cache) reads jax's, flax's and numpy's
    # types, about 10 s of one core; pyproject skips the optional integrations' packages.
    proc = _run("mypy", timeout=900)
    assert proc.returncode == 0, f"mypy (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"
