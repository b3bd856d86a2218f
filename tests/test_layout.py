"""The package's shape: no import circles between modules or between packages, no import
of a higher floor, no module over 600 lines, every subsystem package says what it owns,
and WORKSPACE.md's module map matches the tree."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jtrain"
MAX_LINES = 600  # a failure; past WARN_LINES a module is a signal to look
WARN_LINES = 400


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
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


def package_of(module: str) -> str:
    """The package a module belongs to: its folder under jtrain/ (`jtrain.cli.train` ->
    `jtrain.cli`), a top-level module itself (`jtrain.errors`), the root `jtrain`."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph folded onto packages: an edge wherever any module of one imports
    any module of another (a module of a package importing its siblings is no edge)."""
    out: dict[str, set[str]] = {}
    for module, deps in graph.items():
        here = package_of(module)
        out.setdefault(here, set()).update(package_of(d) for d in deps)
        out[here].discard(here)
        for d in deps:
            out.setdefault(package_of(d), set())
    return out


def _cycles_text(cycles: list[list[str]]) -> str:
    return "; ".join(" -> ".join(c) for c in cycles)


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_package_checker_finds_a_planted_cycle(tmp_path):
    """Two packages whose modules import each other's, one import inside a function: no
    circle between modules, one between the packages."""
    files = {"__init__.py": "", "errors.py": "",
             "a/__init__.py": "", "a/x.py": "from jtrain.b import y\n",
             "a/w.py": "from jtrain import errors\n",
             "b/__init__.py": "", "b/y.py": "import os\n",
             "b/z.py": "def later():\n    from jtrain.a import w\n    return w\n"}
    for name, text in files.items():
        (tmp_path / "jtrain" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "jtrain" / name).write_text(text)
    graph = import_graph(_modules(tmp_path / "jtrain"))
    assert graph["jtrain.b.z"] == {"jtrain.a.w"}  # the import inside the function counts
    assert find_cycles(graph) == []
    packages = package_graph(graph)
    assert packages["jtrain.a"] == {"jtrain.b", "jtrain.errors"}
    assert find_cycles(packages) == [["jtrain.a", "jtrain.b", "jtrain.a"]]
    (tmp_path / "jtrain" / "b" / "z.py").write_text("import os\n")  # the circle undone
    assert find_cycles(package_graph(import_graph(_modules(tmp_path / "jtrain")))) == []


def test_no_import_cycles():
    graph = import_graph(_modules())
    assert len(graph) > 40 and sum(map(len, graph.values())) > 100  # the walk saw the package
    cycles = find_cycles(graph)
    assert not cycles, "import circles: " + _cycles_text(cycles)


def test_no_package_import_cycles():
    """Between packages (a folder under jtrain/, a top-level module, the root) no circle
    either: each package's imports, function-level ones and the root's included, point
    one way."""
    packages = package_graph(layered_graph(_modules()))
    assert len(packages) > 25 and sum(map(len, packages.values())) > 100
    cycles = find_cycles(packages)
    assert not cycles, "package import circles: " + _cycles_text(cycles)


def test_no_module_over_600_lines():
    """Past 600 lines a module fails; past 400 the suite warns (a signal, not a splitter:
    split by concern, never to get under the line)."""
    import warnings

    sizes = {str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines())
             for p in PACKAGE.rglob("*.py")}
    long = {k: n for k, n in sizes.items() if n > MAX_LINES}
    assert not long, f"split these by concern: {long}"
    near = {k: n for k, n in sizes.items() if n > WARN_LINES}
    if near:
        warnings.warn(f"modules past {WARN_LINES} lines (look at them): {near}", stacklevel=1)


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
           "projects": "shared user projects that tests copy into their temp dir",
           "fixtures": "runs written by earlier formats, which this release must still read",
           "core": "units of the core and the ground floor at the package's top level: "
                   "step, state, mesh, precision, errors, paths, boot, host memory, "
                   "redaction"}


def test_tests_are_laid_out_like_the_package():
    tests = Path(__file__).resolve().parent
    folders = [d for d in tests.iterdir() if d.is_dir() and not d.name.startswith((".", "_"))]
    assert folders, "tests for subsystems live in folders named after them"
    for d in folders:
        assert d.name in BY_WHAT or (PACKAGE / d.name / "__init__.py").exists(), \
            f"tests/{d.name}: no jtrain.{d.name}, and not one of {sorted(BY_WHAT)}"
    assert not list((tests / "projects").glob("test_*.py")), "projects/ holds no tests"
    assert not list((tests / "fixtures").rglob("*.py")), "fixtures/ holds data, no code"
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


# Floors, lowest first: a module imports only its own floor or lower ones. The longest
# matching prefix names a module's floor; the package root `jtrain` itself (its lazy
# public names) is an entry point. Within a floor the packages import one another one
# way only (test_no_package_import_cycles).
FLOORS = {
    0: ("jtrain.boot", "jtrain.hostmem", "jtrain.errors", "jtrain.redact", "jtrain.paths",
        "jtrain.internals"),
    1: ("jtrain.config", "jtrain.step", "jtrain.state", "jtrain.optim", "jtrain.precision",
        "jtrain.mesh", "jtrain.losses", "jtrain.metrics", "jtrain.invariant"),
    2: ("jtrain.multihost",),
    3: ("jtrain.data", "jtrain.models", "jtrain.control", "jtrain.checkpoint",
        "jtrain.observe", "jtrain.recipes"),
    4: ("jtrain.engine",),
    5: ("jtrain.verify",),
    6: ("jtrain", "jtrain.main", "jtrain.cli", "jtrain.evaluate", "jtrain.export",
        "jtrain.diff", "jtrain.replay", "jtrain.tune", "jtrain.bench", "jtrain.__main__",
        "jtrain.reference"),
}
# (importer, imported) pairs allowed to go up, each with why.
UPWARD_EXCEPTIONS: set[tuple[str, str]] = set()


def floor(module: str) -> int:
    prefixes = {p: f for f, names in FLOORS.items() for p in names}
    best = max((p for p in prefixes if module == p or module.startswith(p + ".")), key=len)
    return prefixes[best]


def layered_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """import_graph plus the edges to the package root itself (`import jtrain`, `from
    jtrain import X` with X not a module), which import_graph leaves out."""
    graph = import_graph(modules)
    for name, path in modules.items():
        if name == "jtrain":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "jtrain":
                if any(f"jtrain.{a.name}" not in modules for a in node.names):
                    graph[name].add("jtrain")
            elif isinstance(node, ast.Import) and any(a.name == "jtrain" for a in node.names):
                graph[name].add("jtrain")
    return graph


def upward_edges(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, d) for a, deps in graph.items() for d in deps
                  if floor(d) > floor(a) and (a, d) not in UPWARD_EXCEPTIONS)


def test_floor_table_and_checker():
    assert floor("jtrain") == 6 and floor("jtrain.tune.trial") == 6
    assert floor("jtrain.redact") == 0 and floor("jtrain.control.monitors") == 3
    assert floor("jtrain.multihost.heartbeat") == 2 and floor("jtrain.engine.evaluation") == 4
    assert floor("jtrain.verify.resume") == 5 and floor("jtrain.boot") == 0
    planted = {"jtrain.errors": {"jtrain.cli.runner"}, "jtrain.cli.runner": {"jtrain.errors"},
               "jtrain.data.load": {"jtrain"}}
    assert upward_edges(planted) == [("jtrain.data.load", "jtrain"),
                                     ("jtrain.errors", "jtrain.cli.runner")]
    graph = layered_graph(_modules())
    signals = graph["jtrain.control.signals"]  # `from jtrain import boot`: a module
    assert "jtrain.boot" in signals and "jtrain" not in signals
    assert "jtrain" in graph["jtrain.tune.trial"]  # `import jtrain`: the root


def test_no_module_imports_a_higher_floor():
    """Entry points on top, then the verifiers (they launch runs), the run's wiring,
    subsystems, multihost, the core, the ground floor (process start-up, errors,
    redaction, confined paths); no import goes up, and no module below the entry points
    imports the package root."""
    modules = _modules()
    graph = layered_graph(modules)
    up = upward_edges(graph)
    assert not up, "imports of a higher floor: " + "; ".join(f"{a} -> {d}" for a, d in up)
    stale = [e for e in UPWARD_EXCEPTIONS if e[1] not in graph.get(e[0], ())]
    assert not stale, f"exceptions no longer needed, remove them: {stale}"
