"""The package's shape: no import circles, no module over 400 lines, every subsystem
package says what it owns, and WORKSPACE.md's module map matches the tree."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jtrain"
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the jtrain modules it imports, at any depth of the file (an import
    inside a function is still an edge: hiding a circle there is what this forbids).
    A submodule importing its own parent package is not an edge."""
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.split(".")[0] == "jtrain":
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    deps.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.split(".")[0] == "jtrain")
        graph[name] = {d for d in deps if d in modules and d != name
                       and not name.startswith(d + ".")}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles, seen, stack, on_stack = [], set(), [], set()

    def visit(v):
        seen.add(v)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in seen:
                visit(w)
            elif w in on_stack:
                cycles.append(stack[stack.index(w):] + [w])
        stack.pop()
        on_stack.discard(v)

    for v in sorted(graph):
        if v not in seen:
            visit(v)
    return cycles


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = import_graph(_modules())
    assert len(graph) > 40 and sum(map(len, graph.values())) > 100  # the walk saw the package
    cycles = find_cycles(graph)
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_module_over_400_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by concern: {long}"


def test_subsystem_packages_say_what_they_own():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.splitlines()) >= 2, f"{init}: a docstring saying what it owns"
        for sub in init.parent.glob("*.py"):
            if sub.name not in ("__init__.py", "__main__.py"):
                assert sub.stem in doc, f"{init}: the docstring does not mention {sub.stem}"


def test_no_grab_bag_modules():
    assert not [p for p in PACKAGE.rglob("*.py")
                if p.name in ("utils.py", "helpers.py", "misc.py", "common.py")]


def workspace_modules(text: str) -> set[str]:
    """The .py paths under jtrain/ that WORKSPACE.md's indented tree names."""
    block = text.split("## The repo", 1)[1].split("```", 2)[1]
    named, stack = set(), []  # stack: (indent, folder name)
    for line in block.splitlines():
        m = re.match(r"^( *)(\S+)", line)
        if not m:
            continue
        indent, token = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if token.endswith("/"):
            stack.append((indent, token))
        elif token.endswith(".py"):
            named.add("".join(name for _, name in stack) + token)
    return {p for p in named if p.startswith("jtrain/") and not p.endswith("/__init__.py")}


def test_workspace_module_map_matches_the_tree():
    """Every module in the tree (packages by their folder line) appears in WORKSPACE.md's
    map, and every module the map names exists."""
    named = workspace_modules((PACKAGE.parent / "WORKSPACE.md").read_text())
    tree = {str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
            if p.name != "__init__.py"}
    assert sorted(tree - named) == [], "modules missing from WORKSPACE.md's map"
    assert sorted(named - tree) == [], "WORKSPACE.md names modules that do not exist"


# tests/ folders that are not a subsystem's: grouped by what they prove, or shared files
BY_WHAT = {"journeys": "user journeys: jtrain run as its user runs it, in a subprocess",
           "bad_input": "tables of bad input: one line and an exit code per row",
           "projects": "shared user projects that tests copy into their temp dir"}


def test_tests_are_laid_out_like_the_package():
    tests = Path(__file__).resolve().parent
    folders = [d for d in tests.iterdir() if d.is_dir() and not d.name.startswith((".", "_"))]
    assert folders, "tests for subsystems live in folders named after them"
    for d in folders:
        assert d.name in BY_WHAT or (PACKAGE / d.name / "__init__.py").exists(), \
            f"tests/{d.name}: no jtrain.{d.name}, and not one of {sorted(BY_WHAT)}"
    assert not list((tests / "projects").glob("test_*.py")), "projects/ holds no tests"
    journeys = {p.name for p in (tests / "journeys").glob("test_*.py")}
    assert {"test_journeys.py", "test_journeys_library.py"} <= journeys
    names = [p.name for p in tests.rglob("test_*.py")]  # rootdir-based imports: one module
    assert len(names) == len(set(names)), "two test files share a name"  # per name


def test_tests_need_no_convenience_a_user_lacks():
    """tests/README.md's rules: no absl flag marking, no `tests.` package imports, no
    sys.path entry for the repository, no module-level device-count override."""
    tests = Path(__file__).resolve().parent
    banned = {"mark_as_" + "parsed": "marks absl flags parsed (a user's script does not)",
              "from tests.": "imports the tests package (use `from journey import ...`)",
              "import tests.": "imports the tests package",
              "jax_num_cpu_devices": "sets the device count (use @pytest.mark.multidevice)"}
    found = []
    for path in sorted(tests.rglob("*.py")):
        if path.name in ("conftest.py", "test_layout.py"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            found += [f"{path.relative_to(tests)}:{n}: {why}" for word, why in banned.items()
                      if word in line]
    assert not found, "\n".join(found)
