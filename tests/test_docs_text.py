"""The docs speak of the project: the troubleshooting page covers every error a user can
meet, the README stays a front door, and no page says how its text was produced."""

import importlib.util
import re
from pathlib import Path

import pytest

from jtrain import errors

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "guide"
TROUBLESHOOTING = GUIDE / "troubleshooting.md"
TOP_FILES = [REPO / "CHANGELOG.md", REPO / "CONTRIBUTING.md", REPO / "SECURITY.md"]


def _failure_table():
    path = Path(__file__).parent / "bad_input" / "test_failure_table.py"
    spec = importlib.util.spec_from_file_location("failure_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CASES + module.LATE_CASES


def test_troubleshooting_names_every_error_class_and_exit_code():
    text = TROUBLESHOOTING.read_text()
    for cls in errors.ERRORS:
        assert f"`{cls.__name__}`" in text, cls.__name__
        assert f"jtrain: {cls.kind} error: " in text, cls.kind
    for code in errors.EXIT_CODES:
        assert re.search(rf"^\| {code} \|", text, re.M), f"exit code {code}"
    assert "jtrain: internal error: " in text


@pytest.mark.parametrize("case", _failure_table(), ids=lambda c: c[0])
def test_troubleshooting_shows_every_line_of_the_failure_table(case):
    case_id, _, _, code, line = case
    text = TROUBLESHOOTING.read_text()
    assert line in text, f"{case_id}: {line!r} (exit {code}) is not on {TROUBLESHOOTING.name}"


def test_readme_is_a_front_door():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    for page in ("user-models", "data", "checkpoints", "run-control", "evaluation",
                 "multi-host", "tune", "recipes", "precision", "troubleshooting",
                 "ema", "optimizers", "user-models-precision"):
        assert f"(docs/guide/{page}.md)" in text, page
    for page in ("docs/benchmarks.md", "docs/reference/config.md",
                 "docs/reference/exit_codes.md"):
        assert f"({page})" in text, page
    # No timing of its own: measurements live in docs/benchmarks.md with their provenance.
    assert not re.search(r"steps/s|tokens/s|\bmin \d+ s\b|\d ms\b|load average", text)


def test_the_readme_opens_with_the_two_set_up_commands_that_ci_runs():
    """The README's first code block is its two set-up commands: install and train the
    reference run, then install the test extra with the lock and run the suite; .ci/run
    runs the second exactly (its install, then its test command)."""
    text = (REPO / "README.md").read_text()
    first = re.search(r"```bash\n(.*?)```", text, re.S).group(1).splitlines()
    assert len(first) == 2, first
    assert "pip install -e . && python -m jtrain.main --config=configs/base.py" in first[0]
    install, test = first[1].rsplit(" && ", 1)
    assert "pip install -c constraints.txt -e '.[test]'" in install
    assert test == "python -m pytest tests"
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == [install, f". .venv/bin/activate && {test}"], ci
    assert (REPO / "constraints.txt").is_file()


def test_relative_links_between_pages_resolve():
    """Links from README.md, WORKSPACE.md and docs/ to files of this repository exist
    (pages the docs site generates, docs/reference/, are written by their own tool)."""
    pages = _doc_pages()
    elsewhere = ("reference/", "guide/ema.md", "guide/optimizers.md",
                 "guide/user-models-precision.md")  # generated, or other parts' pages
    for page in pages:
        prose = re.sub(r"```.*?```|`[^`\n]*`", "", page.read_text(), flags=re.S)  # not code
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", prose):
            if "://" in target or any(e in target for e in elsewhere) or \
                    target in ("ema.md", "optimizers.md", "user-models-precision.md"):
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(REPO)} -> {target}"


# How a text was produced, never what the project is: issue numbers as sources, the
# people and machines that wrote it, and paths into one machine's home directories.
PROVENANCE = [
    r"(?<![\w&/])#\d+\b", r"\bissues? \d+\b", r"\bthis session\b", r"\bthe lead\b",
    r"\bwas not given a GPU\b", r"\bno GPU was lent\b", r"\bother people's jobs\b",
    r"\bother engineers\b", r"\bshared with other (jobs|work)\b", r"\bother jobs\b",
    r"(?<![\w.])/(?:root|home/[\w.-]+)/", r"\bmeasured here\b", r"\bfor this text\b",
    r"\bthe session that wrote\b",
]


def _doc_pages():
    return [REPO / "README.md", REPO / "WORKSPACE.md", *TOP_FILES,
            *sorted((REPO / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", _doc_pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_docs_do_not_speak_of_how_they_were_written(page):
    text = page.read_text()
    found = [m.group(0) for pattern in PROVENANCE
             for m in re.finditer(pattern, text, re.I)]
    assert not found, f"{page.relative_to(REPO)}: {found}"


def test_the_provenance_patterns_catch_what_they_name():
    samples = ["as issue 12 reported", "see #12", "in this session", "the lead merged",
               "was not given a GPU", "other people's jobs", "under /root/src/x",
               "in /home/ana/jtrain/",
               "measured here on 2 cores"]
    for sample in samples:
        assert any(re.search(p, sample, re.I) for p in PROVENANCE), sample
    for fine in ["`[B, T, D]` # [B, 2]", "the leader process", "step #", "C# code"]:
        assert not any(re.search(p, fine, re.I) for p in PROVENANCE), fine


def test_design_module_table_names_every_top_level_module_and_only_those():
    """docs/design.md's module table: each row's first cell names modules (`x.py`) or
    packages (`x/`) of jtrain/, every one of them exists, and none is left out."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    named = set()
    for line in (root / "docs" / "design.md").read_text().splitlines():
        if line.startswith("| `"):
            named |= set(re.findall(r"`([\w.]+(?:\.py|/))`", line.split(" | ")[0]))
    package = root / "jtrain"
    actual = {p.name for p in package.glob("*.py")} | {
        p.name + "/" for p in package.iterdir() if (p / "__init__.py").is_file()}
    assert sorted(named - actual) == [], "named in docs/design.md but not in jtrain/"
    assert sorted(actual - named) == [], "add these to docs/design.md's module table"


def test_design_names_the_state_fields():
    """docs/design.md's rule 4 lists TrainState's fields, all of them and in order."""
    import dataclasses
    import re
    from pathlib import Path

    from jtrain.state import TrainState

    text = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    rule = re.search(r"4\. \*\*State is a dumb pytree\.\*\*(.*?)\n5\. ", text, re.S).group(1)
    listed = re.search(r"of arrays: (.*?)\(None unless", " ".join(rule.split())).group(1)
    names = [n.strip(" ,") for n in listed.split(",")]
    assert names == [f.name for f in dataclasses.fields(TrainState)]


def test_the_readme_lists_every_command_and_each_module_form():
    """README's "The commands, end to end": the `jtrain A | B | ...` list is exactly the
    dispatcher's commands, and the module forms named are exactly those that exist."""
    from jtrain.cli import COMMANDS

    text = " ".join((REPO / "README.md").read_text().split())
    listed = re.search(r"`jtrain ((?:\w+ \| )+\w+)` are also `python -m jtrain CMD`", text)
    assert listed, "README.md lost its list of commands"
    assert sorted(listed.group(1).split(" | ")) == sorted(COMMANDS)
    modules = {c.prog.split()[-1] for c in COMMANDS.values()
               if c.prog.startswith("python -m jtrain.")}
    named = set(re.findall(r"`(?:python -m )?(jtrain\.\w+)`", text.split("are also", 1)[1]
                           .split("every form starts", 1)[0]))
    assert named == modules, (named, modules)
    for name in COMMANDS:
        if not COMMANDS[name].prog.startswith("python -m jtrain."):
            assert re.search(rf"all but (\w+(, | and ))*{name}\b", text), name


def test_the_benchmarking_guide_names_every_benchmark():
    """docs/guide/benchmarking.md's opening paragraph names each `jtrain bench` command."""
    from jtrain.bench import command as bench

    opening = (GUIDE / "benchmarking.md").read_text().split("\n\n")[1]
    for name in bench.commands():
        assert f"`{name}`" in opening, name


def test_every_test_file_the_docs_name_exists():
    """A test named in prose or code (`tests/journeys/test_notebook.py`) is a file of the
    suite: a renamed or removed test cannot leave the docs pointing at nothing."""
    for page in _doc_pages():
        for path in set(re.findall(r"\btests/[\w/.-]+\.py\b", page.read_text())):
            assert (REPO / path).is_file(), f"{page.relative_to(REPO)} names {path}"


# The top-level keys of the Citation File Format 1.2.0 (its schema's `properties`).
CFF_KEYS = {"abstract", "authors", "cff-version", "commit", "contact", "date-released",
            "doi", "identifiers", "keywords", "license", "license-url", "message",
            "preferred-citation", "references", "repository", "repository-artifact",
            "repository-code", "title", "type", "url", "version"}


def test_citation_file_is_cff_and_names_this_release():
    """CITATION.cff parses as YAML with CFF 1.2.0's required keys and no other keys; its
    version and license are the package's (jtrain.__version__, pyproject's SPDX string)."""
    import tomllib

    import yaml

    import jtrain

    cff = yaml.safe_load((REPO / "CITATION.cff").read_text())
    assert set(cff) <= CFF_KEYS, set(cff) - CFF_KEYS
    assert {"cff-version", "message", "title", "authors"} <= set(cff)
    assert cff["cff-version"] == "1.2.0" and cff["type"] == "software"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert cff["license"] == project["license"]
    assert str(cff["version"]) == jtrain.__version__
    assert cff["authors"] and all(isinstance(a, dict) and ("name" in a or "family-names" in a)
                                  for a in cff["authors"]), cff["authors"]
    assert all(isinstance(cff[k], str) and cff[k].strip() for k in ("message", "title"))


def test_the_flax_migration_page_states_the_shapes_of_its_model():
    """Every `NAME/kernel` [..] or `NAME/bias` [..] on docs/guide/migrate-flax.md is that
    parameter's shape in the page's own model (its `# file: model.py` block, traced by
    jax.eval_shape on the page's [B, 32] inputs), and every parameter is named."""
    import jax
    import numpy as np

    text = (GUIDE / "migrate-flax.md").read_text()
    source = re.search(r"```python\n(# file: model\.py\n.*?)```", text, re.S).group(1)
    scope: dict = {}
    exec(compile(source, "model.py", "exec"), scope)
    x = jax.ShapeDtypeStruct((1, 32), np.float32)
    params = jax.eval_shape(lambda x: scope["MLP"]().init(jax.random.key(0), x), x)["params"]
    shapes = {"/".join(str(k.key) for k in path): list(leaf.shape)
              for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
    stated = {name: [int(d) for d in dims.split(",")] for name, dims in
              re.findall(r"`(\w+/(?:kernel|bias))` \[([\d, ]+)\]", text)}
    assert stated, "the page states no parameter shape"
    assert {n: shapes.get(n) for n in stated} == stated
    assert {n for n in shapes if n.endswith("kernel")} <= set(stated), shapes
