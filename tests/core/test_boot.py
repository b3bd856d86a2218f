"""Start-up: every entry point starts the same way whichever form a user types
(`python -m jtrain.X` or the `jtrain X` script), through `jtrain.boot.start` before JAX
is imported; importing jtrain from a script does nothing to the process."""

import json
import os
import subprocess
import sys

from jtrain import hostmem
from journey import run_python, user_env

CAN = hostmem.tunables_with_hugetlb({}) is not None  # glibc >= 2.35 and THP available
CONFIG = '''from jtrain.config import defaults


def get_config():
    return defaults(model="mlp")
'''
SCRIPT = os.path.join(os.path.dirname(sys.executable), "jtrain")


def _started(tmp_path, argv) -> tuple[subprocess.CompletedProcess, list[dict]]:
    record = tmp_path / "boot.jsonl"
    record.unlink(missing_ok=True)
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=user_env(JTRAIN_BOOT_RECORD=str(record)))
    lines = record.read_text().splitlines() if record.exists() else []
    return proc, [json.loads(ln) for ln in lines]


def test_both_forms_of_each_command_start_the_same_way(tmp_path):
    (tmp_path / "cfg.py").write_text(CONFIG)
    forms = {  # each stops at a missing flag: start-up is all that is compared
        "train": ([sys.executable, "-m", "jtrain.main", "--config=cfg.py"],
                  [SCRIPT, "train", "--config=cfg.py"]),
        "tune": ([sys.executable, "-m", "jtrain.tune", "--config=cfg.py"],
                 [SCRIPT, "tune", "--config=cfg.py"]),
        "evaluate": ([sys.executable, "-m", "jtrain.evaluate"], [SCRIPT, "evaluate"]),
    }
    for command, (module_form, script_form) in forms.items():
        seen = []
        for argv in (module_form, script_form):
            proc, records = _started(tmp_path, argv)
            assert proc.returncode == 2 and "--workdir" in proc.stderr, (argv, proc.stderr)
            assert len(records) == 1, (argv, records)  # one start, after any re-exec
            seen.append(records[0])
        assert seen[0] == seen[1], (command, seen)
        assert seen[0] == {"command": command, "reexecuted": CAN, "hugetlb": CAN,
                           "early_signals": command in ("train", "tune"),
                           "jax_imported": False,
                           "gc_paused": command == "train"}, seen[0]


def test_export_and_bench_start_through_boot(tmp_path):
    for argv, command in (([sys.executable, "-m", "jtrain.export"], "export"),
                          ([sys.executable, "-m", "jtrain.bench", "data", "--bogus=1"],
                           "bench")):
        proc, records = _started(tmp_path, argv)
        assert proc.returncode == 2, proc.stderr
        assert [r["command"] for r in records] == [command]
        assert records[0]["reexecuted"] == CAN and not records[0]["jax_imported"]


def test_importing_jtrain_has_no_side_effects(tmp_path):
    code = """
import signal, sys
before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
import gc
import jtrain
assert "jax" not in sys.modules, "import jtrain imported jax"
assert jtrain.__version__ and "train" in dir(jtrain) and "train" in jtrain.__all__
import jtrain.engine.run, jtrain.engine.assemble  # the modules behind train() and build()
from jtrain import make_mesh, train
import jtrain.main, jtrain.cli, jtrain.evaluate
assert callable(train) and jtrain.train is train and callable(make_mesh)
assert callable(jtrain.build) and not isinstance(jtrain.build, type(sys))
assert {s: signal.getsignal(s) for s in before} == before, "signal handlers changed"
assert gc.isenabled(), "the garbage collector was paused"
try:
    jtrain.no_such_name
except AttributeError as e:
    assert "no_such_name" in str(e)
else:
    raise AssertionError("no AttributeError")
print("ok", "jax" in sys.modules)
"""
    proc = run_python(tmp_path, "-c", code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["ok", "True"]  # `train` brought JAX in on first use



def test_the_train_command_turns_the_collector_back_on_after_its_imports(tmp_path,
                                                                          monkeypatch):
    """In process: with the collector paused as `boot.start("train")` leaves it, the train
    command has it running again (and the imports frozen) by the time the run starts; a
    command that never resumed it would keep every reference cycle of a long run."""
    import gc

    import pytest

    import jtrain.main
    from jtrain import errors
    from jtrain import boot
    from jtrain.engine import run as run_lib

    seen = []

    def run_starts(config, workdir, resolved=None):
        seen.append((gc.isenabled(), gc.get_freeze_count() > 0, list(boot._gc_paused)))
        raise errors.ConfigError("total_steps", "stopped by the test")

    (tmp_path / "cfg.py").write_text(CONFIG)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(run_lib, "train_and_evaluate", run_starts)
    gc.disable()
    boot._gc_paused[:] = [True]
    try:
        with pytest.raises(SystemExit):
            jtrain.main.cli(["jtrain.main", "--config=cfg.py", "--workdir=run"])
    finally:
        gc.unfreeze()
        gc.enable()
        boot._gc_paused.clear()
    assert seen == [(True, True, [])]


def test_a_bad_value_or_workdir_is_one_line_before_jax_is_imported(tmp_path):
    """The train command resolves the config and checks the workdir before it imports
    the engine: the one line comes at once, with JAX, Flax and orbax never imported."""
    (tmp_path / "cfg.py").write_text(CONFIG)
    (tmp_path / "file").write_text("")
    for flag, line in [("--config.optim.lr=nan",
                        "jtrain: config error: optim.lr: must be finite, got nan"),
                       ("--workdir=file/run", "jtrain: workdir error: ")]:
        argv = [SCRIPT, "train", "--config=cfg.py", "--workdir=run", flag]
        proc = subprocess.run([sys.executable, "-X", "importtime", *argv], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300, env=user_env())
        assert proc.returncode == 2, proc.stderr[-2000:]
        errors = [ln for ln in proc.stderr.splitlines() if not ln.startswith("import time:")]
        assert len(errors) == 1 and errors[0].startswith(line), errors
        imported = {ln.rsplit("|", 1)[-1].strip() for ln in proc.stderr.splitlines()
                    if ln.startswith("import time:")}
        assert "jtrain.config" in imported  # the import record is there
        assert not imported & {"jax", "flax", "orbax.checkpoint"}, flag
