"""The suite's only set-up, and no convenience a user lacks: absl flags are NOT marked
parsed, nothing is put on sys.path (jtrain is the installed package), and JAX sees ONE CPU
device — a laptop user's setup.

Tests that need several devices carry `@pytest.mark.multidevice`. JAX fixes its device
count once per process, so this session does not run them itself: when it reaches the
first one it starts ONE child pytest process (`python -m pytest NODEID...`, repo root as
cwd) with 8 fake CPU devices that runs every marked test it collected, and replays the
child's reports here, test by test (pass, fail with its traceback, skip). So the one
command `python -m pytest tests` runs both kinds, and `-k`, `-x`, a single node id all
work as usual. The child is told by JTRAIN_TEST_REPORTS (the file its reports go to).

A skipped test fails the session (CI must not pass with a test that did not run): see
pytest_sessionfinish.

Before any test, the session checks that Python started as the journey tests start it
(temp cwd, no PYTHONPATH) imports this checkout's jtrain, and stops with one line if it
imports another copy (installed from elsewhere) or none.

Helpers for user-journey tests live in tests/journey.py; import them as a plain module
(`from journey import run_python`): pytest puts tests/ on sys.path, no `tests.` package.
"""

import ast
import functools
import gc
import json
import os
import resource
import subprocess
import sys
import time

import jax
import pytest

from jtrain.observe import compiles

CHILD_REPORTS = os.environ.get("JTRAIN_TEST_REPORTS")  # set in the multidevice child only
MULTIDEVICE_COUNT = 8

# The test processes' heaps hold torch, transformers and every test module's JAX caches
# (millions of objects): each of Python's full collections walked all of it, ~0.2 CPU s,
# and they came every few tests (17% of an in-process test file's CPU). Young cycles are
# still collected as usual; the oldest generation is walked 100 times less often. The
# processes the tests start (jtrain, user scripts) keep Python's defaults.
gc.set_threshold(700, 10, 1000)

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", MULTIDEVICE_COUNT if CHILD_REPORTS else 1)
# jtrain's compile cache on from the start, as the first jtrain.train of a process turns it
# on (compile.cache_dir's default): without it, what a test compiles in this process
# depended on whether an earlier test on the same worker had trained (tens of seconds).
compiles.configure_cache_for_reader("auto")  # the defaults' place and size limit


_CONFIG = []
_SKIPPED: list = []


def pytest_sessionstart(session):
    """Every subprocess a test starts must import the jtrain under test: checked once,
    the way the journey tests start Python (a temp cwd, no PYTHONPATH)."""
    if CHILD_REPORTS or hasattr(session.config, "workerinput"):  # the parent checked
        return
    from journey import imported_jtrain

    problem = imported_jtrain(session.config.rootpath)
    if problem:
        pytest.exit(f"jtrain: {problem}", returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_configure(config):
    _CONFIG.append(config)
    if "quick" in (config.getoption("markexpr", "") or "") and not CHILD_REPORTS:
        config.pluginmanager.register(_QuickGuard(), "jtrain-quick-guard")
    if os.environ.get("JTRAIN_TEST_TIMES"):
        config.pluginmanager.register(_Times(os.environ["JTRAIN_TEST_TIMES"]), "jtrain-times")
    from journey import trust_key_file

    trust_key_file()  # before xdist starts its workers: they and every subprocess share it
    _bytecode_once()
    config.addinivalue_line(
        "markers", f"multidevice: needs {MULTIDEVICE_COUNT} fake CPU devices; runs in the "
        "suite's multidevice child process (see tests/conftest.py)")
    config.addinivalue_line("markers", "quick: the edit loop's selection, set by "
                            "tests/conftest.py (`python -m pytest tests -m quick`)")


def _bytecode_once() -> None:
    """Compile jtrain's modules to bytecode once, before the workers start. An editable
    install has no .pyc files, and where PYTHONDONTWRITEBYTECODE is set Python never writes
    them: every one of the suite's hundreds of Python launches would compile jtrain's
    sources again. A user's installed wheel (or a first import without that variable)
    leaves them in place, so this makes the launches what they are for a user."""
    # The test modules too: pytest caches each one's assertion-rewritten bytecode unless
    # bytecode writing is off, and then every worker and the multidevice child rewrite
    # all of them again (~5 s of CPU each). On in each pytest process (this hook runs in
    # every one); the processes the tests start keep the environment as it is.
    sys.dont_write_bytecode = False
    if CHILD_REPORTS or hasattr(_CONFIG[-1], "workerinput"):
        return
    import compileall

    import jtrain

    compileall.compile_dir(os.path.dirname(jtrain.__file__), quiet=1)


def _marked(item) -> bool:
    return item.get_closest_marker("multidevice") is not None


# The groups that take longest (per-file totals of a whole-suite run with
# JTRAIN_TEST_TIMES set), longest first: xdist hands out groups in the order of the items
# (with --no-loadscope-reorder, in pyproject's addopts: by default it orders them by their
# number of tests), so these start first and the short files fill in around them; a long
# group handed out last would leave the other workers idle at the end. Groups not named
# keep their file order.
SLOW_GROUPS = (
    "tests/journeys/test_doc_examples.py",
    "multidevice",
    "tests/verify/test_resume_chaos.py",
    "tests/multihost/test_launch_runs.py",
    "tests/recipes/test_recipes.py",
    "tests/bench/test_peers.py",
    "tests/tune/test_tune_journey.py",
    "tests/journeys/test_async_eval_journey.py",
    "tests/journeys/test_own_step_journey.py",
    "tests/journeys/test_objstore_verify_journey.py",
    "tests/checkpoint/test_elastic_resume.py",
    "tests/bench/test_scaling_bench.py",
    "tests/control/test_run_control_journey.py",
    "tests/engine/test_train_e2e.py",
    "tests/engine/test_loop.py",
    "tests/journeys/test_objstore_journey.py",
    "tests/cli/test_every_form.py",
    "tests/checkpoint/test_store.py",
    "tests/journeys/test_objstore_tune_journey.py",
    "tests/journeys/test_own_step_recipes.py",
    "tests/journeys/test_instruct_recipes.py",
    "tests/observe/test_startup.py",
    "tests/journeys/test_optimizers_journey.py",
    "tests/bad_input/test_bad_input_table.py",
    "tests/multihost/test_launchers.py",
    "tests/multihost/test_ray_job.py",
    "tests/journeys/test_readme_commands.py",
    "tests/checkpoint/test_checkpoint.py",
    "tests/journeys/test_ema_journey.py",
    "tests/journeys/test_hf_journey.py",
    "tests/journeys/test_journeys.py",
    "tests/control/test_watchdog.py",
    "tests/journeys/test_invariant_journey.py",
)


# Also left out of the quick selection: the next longest files of a run of it (benchmark
# runs, transformers' models, a trained best step) and the checks the edit loop runs as
# commands of their own (ruff and mypy; the docs site's build).
QUICK_LEAVES_OUT = (
    "tests/bench/test_bench.py", "tests/bench/test_profile_bench.py",
    "tests/bench/test_data_bench.py", "tests/checkpoint/test_hf.py", "tests/engine/test_sample.py",
    "tests/checkpoint/test_best_step.py", "tests/test_lint.py", "tests/test_docs_site.py",
)


def _quick(item) -> bool:
    """In the quick selection (`-m quick`, CONTRIBUTING.md): every package's unit tests,
    not the journeys, the bad-input tables, the 8-device or slow-marked tests, the tests
    that start a process, nor the longest files (the full suite runs them all)."""
    path = item.nodeid.split("::", 1)[0]
    return not (path.startswith(("tests/journeys/", "tests/bad_input/")) or "journey" in path
                or path in SLOW_GROUPS or path in QUICK_LEAVES_OUT or _marked(item)
                or item.get_closest_marker("slow") or _starts_a_process(item))


# What starting a process looks like in a test's source: `subprocess.*`, `sys.executable`
# (jtrain's verify, a script's launch), and the helpers of tests/ that use them
# (journey.run_python, ...), followed through the test module's own functions and
# fixtures and the tests/ modules it imports from.
_LAUNCH = frozenset({"subprocess", "Popen", "executable"})


def _starts_a_process(item) -> bool:
    names = {item.originalname, *item.fixturenames}
    return bool(names & _launching(str(item.path)))


@functools.cache
def _test_modules() -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    return {os.path.splitext(f)[0]: os.path.join(d, f) for d, _, files in os.walk(here)
            for f in files if f.endswith(".py")}


@functools.cache
def _launching(path: str) -> frozenset:
    """The functions of the tests/ module at `path` that start a process, directly or
    through another of them."""
    tree = ast.parse(open(path).read())
    refs: dict = {}
    found = set(_LAUNCH)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            refs[node.name] = {n.id if isinstance(n, ast.Name) else n.attr
                               for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute))}
        elif isinstance(node, ast.ImportFrom) and node.module in _test_modules():
            other = _test_modules()[node.module]
            if other != path:
                found |= {a.asname or a.name for a in node.names if a.name in _launching(other)}
    while True:
        more = {name for name, used in refs.items() if used & found} - found
        if not more:
            return frozenset(found)
        found |= more


def _group(item) -> str:
    return "multidevice" if _marked(item) else item.nodeid.split("::", 1)[0]


def _suffix_group(item, group: str) -> None:
    """What pytest-xdist's worker means to do with an `xdist_group` mark: append `@group`
    to the node id it reports, which its scheduler groups by. pytest-xdist 3.8 assigns
    `item._nodeid`, which pytest 9.2 no longer reads (node ids are structured: `item._id`),
    so without this every test is scheduled alone: a file's module-scoped run is set up on
    both workers and each worker starts its own multidevice child."""
    if hasattr(item, "_id") and not item.nodeid.endswith("@" + group):
        item._id = type(item._id).parse(f"{item.nodeid}@{group}")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    # tryfirst: pytest-xdist's worker reads the xdist_group marks in its own hook (it
    # appends `@group` to each node id), so they must be on the items before it runs.
    if CHILD_REPORTS:   # the child runs only what its parent handed it, all marked
        return
    for item in items:
        item._jtrain_id = item.nodeid  # before xdist's `@group` suffix: what the child runs
        if _quick(item):
            item.add_marker(pytest.mark.quick)
    # Under pytest-xdist (`--dist loadgroup`, pyproject's addopts): the marked tests go to
    # one worker (one child process for them all), the rest by file, so a file's shared
    # run (a module-scoped fixture) is trained once.
    if config.pluginmanager.hasplugin("xdist"):
        rank = {g: i for i, g in enumerate(SLOW_GROUPS)}
        for item in items:
            item.add_marker(pytest.mark.xdist_group(_group(item)))
            if hasattr(config, "workerinput") and config.getvalue("loadgroup"):
                _suffix_group(item, _group(item))
        items.sort(key=lambda item: rank.get(_group(item), len(rank)))  # stable: files stay
                                                                         # in their order


class _Times:
    """JTRAIN_TEST_TIMES=FILE: one line per test as it ends, in the process that ran it:
    wall seconds, CPU seconds of this process and of the subprocesses it waited for (every
    launch of jtrain or of a script), the latter alone, node id. CPU, not wall: the suite
    shares its cores. (The first 8-device test's line holds the whole child, whose own
    lines follow it.)"""

    def __init__(self, path: str):
        self.path = path

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        wall, own, kids = time.perf_counter(), _cpu(resource.RUSAGE_SELF), \
            _cpu(resource.RUSAGE_CHILDREN)
        yield
        wall, own, kids = (time.perf_counter() - wall, _cpu(resource.RUSAGE_SELF) - own,
                           _cpu(resource.RUSAGE_CHILDREN) - kids)
        with open(self.path, "a") as f:
            f.write(f"{wall:8.2f} {own + kids:8.2f} {kids:8.2f} "
                    f"{getattr(item, '_jtrain_id', item.nodeid)}\n")


class _QuickGuard:
    """Under `-m quick`: a test whose processes (a Python launch, grain's workers, an
    evaluator jtrain starts) used more than half a CPU second fails, saying why. The
    source scan (_starts_a_process) leaves out the launches a test's own code makes; a
    test that starts one another way takes `@pytest.mark.slow`."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.start = _cpu(resource.RUSAGE_CHILDREN)
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = (yield).get_result()
        used = _cpu(resource.RUSAGE_CHILDREN) - self.start
        if call.when == "teardown" and used > 0.5 and item.get_closest_marker("quick"):
            report.outcome = "failed"
            report.longrepr = (f"{item.nodeid}: its processes used {used:.1f} CPU s; the "
                               "quick selection starts none: mark the test "
                               "@pytest.mark.slow (tests/conftest.py, _quick)")


def _cpu(who) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        _SKIPPED.append(report.nodeid)
    if CHILD_REPORTS:
        config = _CONFIG[-1]
        data = config.hook.pytest_report_to_serializable(config=config, report=report)
        with open(CHILD_REPORTS, "a") as f:
            f.write(json.dumps(data) + "\n")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if CHILD_REPORTS or not _marked(item):
        return None
    reports = _child_reports(item.session)
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    mine = reports.get(item._jtrain_id)
    if not mine:
        mine = [_missing_report(item, item.session._jtrain_child_output)]
    for rep in mine:
        rep.nodeid = item.nodeid  # under xdist, with its `@group` suffix
        item.ihook.pytest_runtest_logreport(report=rep)
    # What the skipped protocol's teardown would do: leave the fixtures and collectors
    # (module, class) that the next test does not share.
    item.session._setupstate.teardown_exact(nextitem)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def _child_reports(session) -> dict:
    """Run every marked test of this session in one child process with 8 devices (once)."""
    if hasattr(session, "_jtrain_child"):
        return session._jtrain_child
    config = session.config
    root = str(config.rootpath)
    out = os.path.join(str(config._tmp_path_factory.getbasetemp()), "multidevice.jsonl")
    env = {**os.environ, "JTRAIN_TEST_REPORTS": out}
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
            "--rootdir", root, *[i._jtrain_id for i in session.items if _marked(i)]]
    proc = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True)
    by_id: dict = {}
    if os.path.exists(out):
        with open(out) as f:
            for line in f:
                rep = config.hook.pytest_report_from_serializable(config=config,
                                                                  data=json.loads(line))
                by_id.setdefault(rep.nodeid, []).append(rep)
    session._jtrain_child = by_id
    session._jtrain_child_output = (proc.stdout + proc.stderr)[-4000:]
    return by_id


def _missing_report(item, output: str):
    from _pytest.reports import TestReport
    return TestReport(item.nodeid, item.location, {}, "failed",
                      f"the multidevice child process reported nothing for this test; "
                      f"its output ended:\n{output}", "call")


def pytest_sessionfinish(session, exitstatus):
    """A skip is a failure: on a machine set up as the README says (`pip install -e
    '.[test]'`) every test runs. JTRAIN_TEST_ALLOW_SKIP=1 lets a partial setup pass."""
    if (_SKIPPED and not CHILD_REPORTS and session.exitstatus == 0
            and os.environ.get("JTRAIN_TEST_ALLOW_SKIP") != "1"):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if _SKIPPED and not CHILD_REPORTS:
        terminalreporter.write_line(
            f"jtrain: {len(_SKIPPED)} test(s) skipped, which fails the run (a correctly "
            "set-up machine skips none; JTRAIN_TEST_ALLOW_SKIP=1 allows it): "
            + ", ".join(_SKIPPED[:5]), red=True)

