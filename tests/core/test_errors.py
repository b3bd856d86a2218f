"""Errors keep what they name as fields: `e.key`, `e.why`; the one line is built from
them (`errors.render`), and no module of jtrain recovers a key by splitting an error's
text. docs/reference/exit_codes.md is what `python -m jtrain.cli.exit_codes --markdown` writes."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest
from absl import flags

from jtrain import errors
from jtrain.cli import runner as cli
from jtrain.cli import exit_codes
from jtrain.data.load import load_named

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "jtrain"


@pytest.mark.parametrize("cls", errors.ERRORS)
def test_every_error_keeps_key_and_why(cls):
    e = cls("data.source", "cannot import 'nomod'")
    assert (e.key, e.why) == ("data.source", "cannot import 'nomod'")
    assert str(e) == "data.source: cannot import 'nomod'"
    assert errors.render(e) == f"jtrain: {cls.kind} error: data.source: cannot import 'nomod'"
    assert errors.exit_code(e) == cls.exit_code == e.exit_code
    back = pickle.loads(pickle.dumps(e))  # across grain workers and processes
    assert type(back) is cls and (back.key, back.why, str(back)) == (e.key, e.why, str(e))


@pytest.mark.parametrize("cls", [c for c in errors.ERRORS if c is not errors.ConfigError])
def test_a_message_names_no_key(cls):
    e = cls("train_data: the dataset is empty")
    assert e.key is None and e.why == "train_data: the dataset is empty"
    assert errors.render(e) == f"jtrain: {cls.kind} error: train_data: the dataset is empty"


def test_config_error_with_a_key_alone():
    e = errors.ConfigError("optim.lr")
    assert (e.key, e.why, str(e)) == ("optim.lr", "", "optim.lr")


def test_render_uses_the_fields_first_line_and_masks_secrets():
    e = errors.ConfigError("writers.uri", "cannot reach https://me:hunter2@example.com\nmore")
    line = errors.render(e)
    # everything between :// and the last @ is masked, the user name too
    assert line == "jtrain: config error: writers.uri: cannot reach https://<redacted>@example.com"
    assert "hunter2" not in line and "more" not in line
    assert errors.render(ValueError("boom\ntrace")) == "jtrain: internal error: boom"


def test_exit_codes_doc_matches_the_generator():
    on_disk = (REPO / "docs" / "reference" / "exit_codes.md").read_text()
    assert on_disk == exit_codes.markdown(), (
        "docs/reference/exit_codes.md is stale: python -m jtrain.cli.exit_codes --markdown > "
        "docs/reference/exit_codes.md")


def test_exit_code_table_lists_every_error_under_its_code():
    text = exit_codes.markdown()
    assert set(errors.EXIT_CODES) == {0, 1, 2, 3, 4, 5, 6, 7}
    for cls in errors.ERRORS:
        assert cls.exit_code in errors.EXIT_CODES, cls
        row = next(r for r in text.splitlines() if r.startswith(f"| {cls.exit_code} |"))
        assert f"`{cls.__name__}`" in row
    subclasses = {c for c in vars(errors).values()
                  if isinstance(c, type) and issubclass(c, errors.JtrainError)}
    assert subclasses - {errors.JtrainError} == set(errors.ERRORS)  # none left out


def test_readme_and_workspace_link_the_table_instead_of_copying_it():
    for doc in ("README.md", "WORKSPACE.md"):
        text = (REPO / doc).read_text()
        assert "docs/reference/exit_codes.md" in text, doc
        assert "| 6 |" not in text, doc


@pytest.mark.parametrize("key, error", [("data.source", errors.DataError),
                                        ("model.factory", errors.ConfigError)])
def test_load_named_raises_the_callers_error_with_its_key(key, error):
    with pytest.raises(error) as e:
        load_named("no_such_module_here:fn", key, error)
    assert e.value.key == key and e.value.why.startswith("cannot import 'no_such_module_here'")
    with pytest.raises(errors.DataError) as e:
        load_named("os", "data.transform")
    assert (e.value.key, e.value.why) == ("data.transform",
                                          "expected 'package.module:function', got 'os'")


def test_describe_flag_error_returns_key_and_why():
    fv = flags.FlagValues()
    flags.DEFINE_integer("steps", 1, "", flag_values=fv)
    with pytest.raises(flags.Error) as e:
        fv(["prog", "--steps=x"])
    assert cli.describe_flag_error(e.value, ["--steps=x"]) == (
        "--steps", "must be an integer, got 'x'")
    with pytest.raises(flags.Error) as e:
        fv(["prog", "--stepz=1"])
    assert cli.describe_flag_error(e.value, ["--stepz=1"]) == ("--stepz", "unknown flag")


# -- no module recovers (key, why) from an error's text --------------------------------

_SPLITS = {"split", "rsplit", "partition", "rpartition"}
_ERROR_TEXT = {"str", "first_line", "describe_flag_error", "render"}  # calls giving it


def _is_split(node) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
        and node.func.attr in _SPLITS


def _error_text(expr) -> bool:
    """`str(x)`, `errors.first_line(x)`, `describe_flag_error(...)`, `x.args[...]`."""
    if isinstance(expr, ast.Call):
        f = expr.func
        return (f.id if isinstance(f, ast.Name) else getattr(f, "attr", "")) in _ERROR_TEXT
    return isinstance(expr, ast.Subscript) and isinstance(expr.value, ast.Attribute) \
        and expr.value.attr == "args"


def text_splits(source: str) -> list[tuple[int, str]]:
    """(line, what) for each place that splits an error's text: a split at the key/why
    separator `": "` of what str() / first_line / describe_flag_error / .args gave, and
    any split of an expression that reads the name an `except ... as e` bound, inside
    that handler (`str(e).split(";")`, `e.args[0].partition(...)`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if _is_split(node) and _error_text(node.func.value) and node.args \
                and isinstance(node.args[0], ast.Constant) and node.args[0].value == ": ":
            found.append((node.lineno, f'.{node.func.attr}(": ") of an error\'s text'))
        if isinstance(node, ast.ExceptHandler) and node.name:
            for inner in (n for stmt in node.body for n in ast.walk(stmt)):
                if _is_split(inner) and any(isinstance(n, ast.Name) and n.id == node.name
                                            for n in ast.walk(inner.func.value)):
                    found.append((inner.lineno, f"{inner.func.attr} of {node.name}'s text"))
    return found


def test_the_finder_finds_planted_splits():
    planted = '''
try:
    f()
except ValueError as e:
    key, why = str(e).split(": ", 1)
    head = errors.first_line(e).partition(";")[0]
    fine = "a:b".split(":")
key, _, why = cli.describe_flag_error(err, argv).partition(": ")
recorded_source.split(": ", 1)
'''
    assert sorted(line for line, _ in text_splits(planted)) == [5, 5, 6, 8]


def test_no_module_splits_an_errors_text():
    found = [f"{path.relative_to(REPO)}:{line}: {why}"
             for path in sorted(PACKAGE.rglob("*.py"))
             for line, why in text_splits(path.read_text())]
    assert not found, "read e.key / e.why (or give the error a field) instead: " + \
        "; ".join(found)


def test_further_fields_travel_with_the_error():
    e = errors.RestoreError("the config changed; to resume anyway, allow them",
                            changed_keys=["optim.lr"], what="the config changed")
    back = pickle.loads(pickle.dumps(e))
    assert (back.changed_keys, back.what, back.key) == (["optim.lr"], "the config changed", None)


def test_disk_full_names_what_was_being_written_from_its_field():
    save = errors.CheckpointError("saving step 3 in /w failed: OSError: [Errno 28] No space "
                                  "left on device", what="saving step 3 in /w")
    line = errors.render(errors.classify(save))
    assert line.startswith("jtrain: disk error: no space left on the device holding the "
                           "workdir (saving step 3 in /w); free space")
