"""docs/reference/api.md covers every public name: each name of `jtrain.__all__` and of
the public modules' `__all__` has an entry there (`::: dotted.path`, by its public name or
where it is defined), and the entry's docstring explains it, carries an example (an
`Examples:` section with code) and, for a dataclass or a named tuple, lists its fields (an
`Attributes:` section). The site's build (tests/test_docs_site.py) renders these entries
with their signatures; this test is what keeps a new public name from going unlisted."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "reference" / "api.md"
# The modules a user's program imports from (README, docs/guide/, the recipes): each
# keeps an `__all__` of its public names.
PUBLIC_MODULES = ("jtrain", "jtrain.step", "jtrain.state", "jtrain.losses", "jtrain.data",
                  "jtrain.errors", "jtrain.checkpoint", "jtrain.evaluate", "jtrain.diff",
                  "jtrain.replay", "jtrain.export", "jtrain.metrics")


def entries(text: str) -> list[str]:
    return re.findall(r"^::: ([\w.]+)\s*$", text, re.M)


def public_names():
    """(public dotted name, object, the dotted paths an entry may use) for every name."""
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        assert isinstance(getattr(module, "__all__", None), list), f"{module_name}: no __all__"
        for name in module.__all__:
            obj = getattr(module, name)
            paths = {f"{module_name}.{name}"}
            if inspect.isclass(obj) or inspect.isroutine(obj):
                paths.add(f"{obj.__module__}.{obj.__qualname__}")
            yield f"{module_name}.{name}", obj, paths


def resolve(path: str):
    """The object and its docstring at `path` (a module attribute's docstring: the string
    right after its assignment, as the site reads it)."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        obj = module
        for part in parts[i:]:
            obj = getattr(obj, part)
        if inspect.isclass(obj) or inspect.isroutine(obj):
            return obj, inspect.getdoc(obj) or ""
        body = ast.parse(inspect.getsource(module)).body
        for node, after in zip(body, body[1:], strict=False):
            targets = [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
            if parts[-1] in targets and isinstance(after, ast.Expr) and \
                    isinstance(after.value, ast.Constant):
                return obj, inspect.cleandoc(after.value.value)
        return obj, ""
    raise AssertionError(f"{path}: not importable")


def fields(obj) -> list[str]:
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
        return [f.name for f in dataclasses.fields(obj)]
    if inspect.isclass(obj) and issubclass(obj, tuple) and hasattr(obj, "_fields"):
        return list(obj._fields)
    return []


def problems(path: str, obj, doc: str) -> list[str]:
    found = []
    summary = doc.split("\n\n")[0].strip()
    if not summary or summary.startswith(("Examples:", "Attributes:", "Args:")):
        found.append(f"{path}: no text that explains it")
    examples = doc.split("Examples:", 1)[1] if "Examples:" in doc else ""
    if "```" not in examples and ">>>" not in examples:
        found.append(f"{path}: no example (an `Examples:` section with code)")
    listed = []  # a subclass may leave its base's fields to the base's entry
    for cls in (obj.__mro__ if inspect.isclass(obj) else ()):
        text = doc if cls is obj else (inspect.getdoc(cls) or "")
        if "Attributes:" in text:
            listed += re.findall(r"^    (\w+):", text.split("Attributes:", 1)[1], re.M)
    missing = [f for f in fields(obj) if f not in listed]
    if missing:
        found.append(f"{path}: fields not in its `Attributes:` section: {missing}")
    return found


def test_every_public_name_has_an_entry_with_an_explanation_and_an_example():
    on_page = entries(PAGE.read_text())
    assert len(on_page) == len(set(on_page)), "an entry listed twice"
    missing, found = [], []
    for public, obj, paths in public_names():
        listed = [p for p in on_page if p in paths]
        if not listed:
            missing.append(public)
            continue
        entry, doc = resolve(listed[0])
        assert entry is obj, f"{listed[0]} is not {public}"
        found += problems(listed[0], obj, doc)
    assert not missing, f"public names not on {PAGE.relative_to(REPO)}: {missing}"
    assert not found, "\n".join(found)


def test_the_checks_catch_what_they_name():
    @dataclasses.dataclass
    class Result:
        """What a run returns.

        Attributes:
            state: the final state.

        Examples:
            ```python
            print(Result(1, 2))
            ```
        """
        state: int
        history: int

    def bare(x):
        """Adds one."""

    assert problems("Result", Result, inspect.getdoc(Result)) == [
        "Result: fields not in its `Attributes:` section: ['history']"]
    assert problems("bare", bare, inspect.getdoc(bare)) == [
        "bare: no example (an `Examples:` section with code)"]
    assert entries("x\n\n::: jtrain.a.b\n\n::: jtrain.c\n") == ["jtrain.a.b", "jtrain.c"]
    assert resolve("jtrain.losses.ROW_MASK")[1].startswith("The batch key")
