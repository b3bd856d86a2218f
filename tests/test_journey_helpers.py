"""The suite's own guarantee: every subprocess a test starts imports the jtrain under
test. The session checks it before any test (tests/conftest.py) and stops with one line
when Python, started as the journey tests start it, imports another copy."""

import subprocess
import sys
from pathlib import Path

from journey import imported_jtrain

ROOT = Path(__file__).resolve().parents[1]


def test_a_journey_imports_this_checkouts_jtrain():
    assert imported_jtrain(ROOT) is None


def test_another_copy_is_named_in_one_line(tmp_path):
    problem = imported_jtrain(tmp_path)
    assert f"imports {ROOT / 'jtrain' / '__init__.py'}, not this checkout's " \
           f"{tmp_path / 'jtrain' / '__init__.py'}" in problem
    assert problem.endswith(f"run `pip install -e '.[test]'` from {tmp_path}")


def test_the_session_stops_before_any_test_when_it_would_test_another_copy(tmp_path):
    """A checkout at tmp_path whose environment has jtrain installed from ROOT."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
         f"{Path(__file__).resolve()}::test_a_journey_imports_this_checkouts_jtrain"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "jtrain: " in proc.stdout + proc.stderr
    assert "pip install -e" in proc.stdout + proc.stderr
    assert "passed" not in proc.stdout
