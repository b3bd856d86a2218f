"""Every example in README.md and docs/guide/*.md that a reader may paste runs as written.

A fenced block preceded by the line `<!-- run -->` runs from a fresh temp directory (one
per page, blocks in page order, so a later block sees what an earlier one wrote), as a
user pastes it: a ```python block whose first line is `# file: NAME` is saved as NAME; any
other ```python block runs as a script (`python block.py`); a ```bash block runs line by
line (`\\` continues a line; `python` is this venv's, `jtrain` its console script), each
line must exit 0 and print no traceback. The page's `configs/` and `launch/` are copied
in, so repository-relative commands work. A block preceded by `<!-- tested: PATH -->` is
run by that test instead (which must exist and read the page). Every other python / bash
block must be plainly not runnable: a sketch or a cluster command, which the page says.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from journey import user_env

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs" / "guide").glob("*.md"))]
FENCE = re.compile(r"(?:^<!-- (run|tested: [^>]*?) -->\n)?^```(\w*)\n(.*?)^```", re.M | re.S)


def blocks(page: Path) -> list[tuple[str | None, str, str]]:
    """(marker or None, language, body) of every fenced block of `page`."""
    return [(m or None, lang, body) for m, lang, body in FENCE.findall(page.read_text())]


def _name(page: Path) -> str:
    return str(page.relative_to(REPO))


RUNNABLE = [p for p in PAGES if any(m == "run" for m, _, _ in blocks(p))]


def bash_lines(body: str) -> list[list[str]]:
    """The commands of a bash block: continuations joined, comments and blanks dropped."""
    joined = re.sub(r"\\\n\s*", " ", body)
    return [argv for line in joined.splitlines() if (argv := shlex.split(line, comments=True))]


def _argv(argv: list[str]) -> list[str]:
    head = {"python": sys.executable, "jtrain": str(Path(sys.executable).with_name("jtrain"))}
    assert argv[0] in head, f"a runnable bash line starts with python or jtrain: {argv}"
    return [head[argv[0]], *argv[1:]]


def _check(proc: subprocess.CompletedProcess, what) -> None:
    assert proc.returncode == 0, (what, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, (what, proc.stderr[-3000:])


@pytest.mark.parametrize("page", RUNNABLE, ids=_name)
def test_page_examples_run_as_pasted(page, tmp_path):
    for folder in ("configs", "launch"):
        shutil.copytree(REPO / folder, tmp_path / folder)
    env = user_env(JAX_COMPILATION_CACHE_DIR=str(tmp_path / ".jax_cache"),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    ran = 0
    for i, (marker, lang, body) in enumerate(blocks(page)):
        if marker != "run":
            continue
        ran += 1
        if lang == "python" and body.startswith("# file: "):
            first, _, rest = body.partition("\n")
            (tmp_path / first[len("# file: "):].strip()).write_text(rest)
        elif lang == "python":
            script = tmp_path / f"block_{i}.py"
            script.write_text(body)
            _check(subprocess.run([sys.executable, script.name], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=300), (page, i))
        elif lang == "bash":
            for argv in bash_lines(body):
                _check(subprocess.run(_argv(argv), cwd=tmp_path, env=env,
                                      capture_output=True, text=True, timeout=300), argv)
        else:
            pytest.fail(f"{_name(page)} block {i}: a runnable block is python or bash")
    assert ran


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_example_is_run_or_plainly_not_runnable(page):
    """A `tested: PATH` block names a test file that exists and reads this page (or holds
    the example's longest line)."""
    for marker, _lang, body in blocks(page):
        if marker and marker.startswith("tested: "):
            test = REPO / marker[len("tested: "):].strip()
            assert test.is_file(), (_name(page), marker)
            source, longest = test.read_text(), max(body.splitlines(), key=len).strip()
            assert page.name in source or longest in source, \
                f"{test} neither reads {_name(page)} nor holds its example"


def test_bash_lines_join_continuations_and_drop_comments():
    body = "# a comment\npython -m jtrain.main --a=1 \\\n  --b=2   # note\n\njtrain evaluate\n"
    assert bash_lines(body) == [["python", "-m", "jtrain.main", "--a=1", "--b=2"],
                                ["jtrain", "evaluate"]]
