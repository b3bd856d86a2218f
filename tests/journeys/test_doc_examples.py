"""Every python and bash block in README.md and docs/ runs as written, is run by a test
that names it, or says why it cannot run (docs/reference/ is generated from the code and
holds no such block: test_reference_pages_hold_no_code_block).

A fenced block preceded by the line `<!-- run -->` runs from a fresh temp directory (one
per page, blocks in page order, so a later block sees what an earlier one wrote), as a
user pastes it: a ```python block whose first line is `# file: NAME` is saved as NAME; any
other ```python block runs as a script (`python block.py`); a ```bash block runs line by
line (`\\` continues a line; `python` is this venv's, `jtrain` its console script), each
line must exit 0 and print no traceback. The page's `configs/` and `launch/` are copied
in, so repository-relative commands work. A block preceded by `<!-- tested: PATH -->` is
run by that test instead (which must exist and read the page); the README's
`<!-- readme-commands: PATH ... -->` block is one of those. A block preceded by
`<!-- not run: REASON -->` is not run, for the reason given (hardware, network, a
cluster, minutes of CPU); the docs site shows the reason above the block
(docs/site_hooks.py). A python or bash block with none of these fails
test_every_code_block_runs_or_says_why_not, and docs/index.md states the counts
(test_the_index_states_the_true_counts).
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
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(p for p in DOCS.rglob("*.md")
                                     if not p.is_relative_to(DOCS / "reference"))]
FENCE = re.compile(r"(?:^<!-- (run|(?:tested|not run|readme-commands): [^>]*?) -->\n)?"
                   r"^```(\w*)\n(.*?)^```", re.M | re.S)
CODE = ("python", "bash")  # what a reader pastes; other fences are output and listings


def blocks(page: Path) -> list[tuple[str | None, str, str]]:
    """(marker or None, language, body) of every fenced block of `page`."""
    return [(m or None, lang, body) for m, lang, body in FENCE.findall(page.read_text())]


def kind(marker: str | None) -> str:
    """"run", "tested", "not run" or "unmarked"."""
    if marker is None:
        return "unmarked"
    head = marker.split(":", 1)[0]
    return "tested" if head == "readme-commands" else head


def _tested_path(marker: str) -> Path:
    return REPO / marker.split(":", 1)[1].split()[0]


def counts(pages=None) -> dict[str, int]:
    """How many python / bash blocks of `pages` (default: all) are of each kind."""
    found = {"run": 0, "tested": 0, "not run": 0, "unmarked": 0}
    for page in PAGES if pages is None else pages:
        for marker, lang, _ in blocks(page):
            if lang in CODE:
                found[kind(marker)] += 1
    return found


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


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    """One persistent compilation cache for every page's processes: the same small models
    and eager ops recur from page to page (jtrain's runs use their own, compile.cache_dir)."""
    return tmp_path_factory.mktemp("jax_cache")


@pytest.mark.parametrize("page", RUNNABLE, ids=_name)
def test_page_examples_run_as_pasted(page, tmp_path, jax_cache):
    for folder in ("configs", "launch"):
        shutil.copytree(REPO / folder, tmp_path / folder)
    env = user_env(JAX_COMPILATION_CACHE_DIR=str(jax_cache),
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
def test_every_code_block_runs_or_says_why_not(page):
    """A python / bash block is run here, run by a named test that exists and reads this
    page (or holds the example's longest line), or carries a reason it is not run."""
    for i, (marker, lang, body) in enumerate(blocks(page)):
        if lang not in CODE:
            continue
        assert marker, (f"{_name(page)} block {i} ({lang}): mark it <!-- run -->, "
                        "<!-- tested: PATH --> or <!-- not run: REASON -->")
        if kind(marker) == "not run":
            assert len(marker.split(":", 1)[1].split()) >= 2, (_name(page), i, marker)
        if kind(marker) == "tested":
            test = _tested_path(marker)
            assert test.is_file(), (_name(page), marker)
            source, longest = test.read_text(), max(body.splitlines(), key=len).strip()
            assert page.name in source or longest in source, \
                f"{test} neither reads {_name(page)} nor holds its example"


def index_sentence(found: dict[str, int]) -> str:
    total = sum(found.values())
    return (f"Of the {total} python and bash blocks in README.md and these pages, "
            f"{found['run']} run in the test suite as written, {found['tested']} are run "
            f"by the test they name, and {found['not run']} are not run, each with its "
            "reason shown above it.")


def test_the_index_states_the_true_counts():
    """docs/index.md says how many blocks run, are tested elsewhere and are not run."""
    found = counts()
    assert found["unmarked"] == 0, found
    text = " ".join((DOCS / "index.md").read_text().split())
    assert index_sentence(found) in text, f"docs/index.md should say: {index_sentence(found)}"


def test_reference_pages_hold_no_code_block():
    """The generated reference is tables and prose: no block there escapes the rule."""
    for page in sorted((DOCS / "reference").glob("*.md")):
        assert not FENCE.search(page.read_text()), _name(page)


def test_counts_see_each_kind_of_marker(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("<!-- run -->\n```bash\npython -V\n```\n\n<!-- tested: tests/x.py -->\n"
                    "```python\nx = 1\n```\n\n<!-- not run: needs a GPU -->\n```bash\nnvidia-smi\n"
                    "```\n\n```python\ny = 2\n```\n\n```\noutput\n```\n")
    assert counts([page]) == {"run": 1, "tested": 1, "not run": 1, "unmarked": 1}


def test_bash_lines_join_continuations_and_drop_comments():
    body = "# a comment\npython -m jtrain.main --a=1 \\\n  --b=2   # note\n\njtrain evaluate\n"
    assert bash_lines(body) == [["python", "-m", "jtrain.main", "--a=1", "--b=2"],
                                ["jtrain", "evaluate"]]
