"""Start-up as a user sees it (the built-in MLP on a user's table): the compile cache
(cold, warm, off), the time-to-first-step breakdown in the header and summary.json, no
recompiles on the eval's padded last batch or on a resume, and a TensorBoard writer that
does not import torch."""

import json
import os
import shutil

from journey import copy_project, run_python

CONFIG = '''
from jtrain.config import defaults


def get_config():
    c = defaults(model="mlp")
    c.total_steps = 6
    c.model.update(num_outputs=2, hidden=(16,))
    c.data.update(source="tabular:make", batch_size=8, kwargs={"eval_rows": 20})
    c.optim.update(warmup_steps=1)
    # 20 eval rows in batches of 8: the last batch is padded (4 rows)
    c.eval.update(every_steps=3, num_batches=0, batch_size=8)
    c.log.every_steps = 3
    c.checkpoint.every_steps = 3
    return c
'''

PHASES = ("imports", "distributed", "data", "build", "state", "writers", "compile")


def _run(cwd, workdir, *extra, cache="xdg"):
    copy_project(cwd, "tabular")  # the user's data module
    return run_python(cwd, "-m", "jtrain.main", "--config=cfg.py", f"--workdir={workdir}",
                      *extra, XDG_CACHE_HOME=str(cwd / cache))


def _summary(cwd, workdir):
    with open(cwd / workdir / "summary.json") as f:
        return json.load(f)


def test_cold_then_warm_cache_and_a_resume_compile_nothing_again(tmp_path):
    (tmp_path / "cfg.py").write_text(CONFIG)
    cold = _run(tmp_path, "a")
    assert cold.returncode == 0, cold.stderr[-2000:]
    s = _summary(tmp_path, "a")
    # The breakdown: every phase, and they add up to the time to first step.
    assert "jtrain: first step after" in cold.stdout + cold.stderr
    parts = [s[f"startup/{p}_sec"] for p in PHASES] + [s["startup/other_sec"]]
    assert min(parts) >= 0
    assert abs(sum(parts) - s["perf/time_to_first_step_sec"]) < 0.05
    # Cold: everything compiled and written to $XDG_CACHE_HOME/jtrain/xla.
    assert s["compile/cache_hits"] == 0 and s["compile/cache_misses"] >= 3
    assert os.listdir(tmp_path / "xdg" / "jtrain" / "xla")
    # Two evals over the whole eval set (padded last batch) and saves: the eval step
    # and the save check compile once each, nothing compiles again.
    assert s["compile/recompiles"] == 0, s["compile/after_first_step_causes"]
    assert {c["function"] for c in s["compile/after_first_step_causes"]} == {
        "jit(eval_step)", "jit(params_finite)"}
    assert "again" not in cold.stderr

    warm = _run(tmp_path, "b")
    assert warm.returncode == 0, warm.stderr[-2000:]
    w = _summary(tmp_path, "b")
    assert w["compile/cache_misses"] == 0
    assert w["compile/cache_hits"] == s["compile/cache_misses"]
    assert w["state_sha256"] == s["state_sha256"]  # a cached executable computes the same

    # A resume (from step 3) with the cache off: it compiles what a fresh run does, once.
    shutil.rmtree(tmp_path / "a" / "checkpoints" / "6")
    resumed = _run(tmp_path, "a", "--config.compile.cache_dir=")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    r = _summary(tmp_path, "a")
    assert r["resumed_from"] == 3 and r["state_sha256"] == s["state_sha256"]
    assert r["compile/cache_hits"] == r["compile/cache_misses"] == 0
    assert r["compile/recompiles"] == 0, r["compile/after_first_step_causes"]
    assert "compile cache off" in resumed.stderr


def test_tensorboard_writer_imports_neither_torch_nor_boto3(tmp_path):
    script = '''
import sys
from jtrain.observe import writers
w = writers.MetricWriter("run", writers.config_lib.resolve({}).log, is_primary=True)
w.write_scalars(1, {"train/loss": 1.5})
w.close()
print("torch imported:", "torch" in sys.modules, "boto3 imported:", "boto3" in sys.modules)
from tensorboardX import SummaryWriter  # the user's own use still works
print("SummaryWriter:", SummaryWriter.__name__)
from tensorboardX import record_writer  # and its S3 backend, when boto3 is installed
print("s3 backend:", record_writer.S3_ENABLED, callable(record_writer.boto3.client))
'''
    (tmp_path / "tb.py").write_text(script)
    p = run_python(tmp_path, "tb.py")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "torch imported: False boto3 imported: False" in p.stdout
    assert "SummaryWriter: SummaryWriter" in p.stdout and "s3 backend: True True" in p.stdout
    assert any(n.startswith("events") for n in os.listdir(tmp_path / "run" / "tb"))


def test_a_compile_after_the_first_step_is_named_with_its_new_shapes():
    import jax
    import numpy as np

    from jtrain.engine.loop import _changed
    from jtrain.observe import compiles

    def double_it(x):
        return x * 2

    f = jax.jit(double_it)
    with compiles.Recorder() as rec:
        f(np.ones(3, np.float32)).block_until_ready()
        rec.first_step_done()
        f(np.ones(3, np.float32)).block_until_ready()  # the same shapes: no compile
        assert rec.after_first_step == []
        f(np.ones(5, np.float32)).block_until_ready()
    (c,) = rec.recompiles
    assert c["function"] == "jit(double_it)" and c["shapes"] == "float32[5]"
    assert _changed(c["before"], c["shapes"]) == "#0: float32[3] -> float32[5]"
    assert rec.summary()["compile/recompiles"] == 1 and rec.unreported() == [c]
    assert rec.unreported() == []


def test_an_explicit_compile_cache_dir_is_where_the_cache_goes(tmp_path):
    """compile.cache_dir=PATH (relative to the cwd) holds the cache; the default place
    ($XDG_CACHE_HOME/jtrain/xla) stays untouched. `jtrain.evaluate` of that run caches its
    programs in the default place and writes nothing into PATH."""
    (tmp_path / "cfg.py").write_text(CONFIG)
    p = _run(tmp_path, "a", "--config.compile.cache_dir=mine/xla", "--config.total_steps=1",
             "--config.eval.every_steps=0", "--config.checkpoint.every_steps=0")
    assert p.returncode == 0, p.stderr[-2000:]
    assert os.listdir(tmp_path / "mine" / "xla")
    assert not os.path.exists(tmp_path / "xdg" / "jtrain" / "xla")
    s = _summary(tmp_path, "a")
    assert s["compile/cache_misses"] >= 1 and s["compile/cache_hits"] == 0
    # Evaluating the run uses the cache in the default place, not the run's recorded
    # directory (a run directory is data: opening it writes nothing outside it).
    mine = sorted(os.listdir(tmp_path / "mine" / "xla"))
    p = run_python(tmp_path, "-m", "jtrain.evaluate", "--workdir=a", "--noplots",
                   XDG_CACHE_HOME=str(tmp_path / "xdg"))
    assert p.returncode == 0, p.stderr[-2000:]
    assert sorted(os.listdir(tmp_path / "mine" / "xla")) == mine
    assert any("eval_step" in f for f in os.listdir(tmp_path / "xdg" / "jtrain" / "xla"))


def test_a_script_and_a_command_leave_without_walking_their_heap(tmp_path):
    """At the exit of a script that trained and of `jtrain evaluate`, the heap JAX, Flax,
    orbax and grain built is frozen before the interpreter's teardown (0.3 CPU s each):
    the user's own exit hook, registered first and so run last, sees it frozen and the
    run's files whole.

    The same script: start-up pays only for the Flax API the model uses, a user's Linen
    model trains, evaluates and checkpoints without flax.nnx ever being imported (~0.2 s).
    """
    copy_project(tmp_path, "linen_classifier")
    hook = ("import atexit, gc\n"
            "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count() > 0))\n")
    (tmp_path / "train.py").write_text(hook + '''
import sys
import numpy as np
import jtrain
from linen_classifier import Net

x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
y = (x[:, 0] > 0).astype(np.int32)
r = jtrain.train({"total_steps": 4, "data": {"batch_size": 8}, "eval": {"every_steps": 4}},
                 "run", model=Net(), train_data=(x, y), eval_data=(x[:16], y[:16]))
print("step", r.summary["step"], "nnx imported:", "flax.nnx" in sys.modules)
''')
    p = run_python(tmp_path, "train.py")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.splitlines()[-2:] == ["step 4 nnx imported: False",
                                          "frozen at exit: True"], p.stdout
    assert _summary(tmp_path, "run")["step"] == 4
    assert os.listdir(tmp_path / "run" / "checkpoints")
    copy_project(tmp_path, "tabular")
    (tmp_path / "cfg.py").write_text(CONFIG)
    p = run_python(tmp_path, "-m", "jtrain.main", "--config=cfg.py", "--workdir=cli")
    assert p.returncode == 0, p.stderr[-2000:]
    (tmp_path / "evaluate.py").write_text(
        hook + "import runpy\nrunpy.run_module('jtrain.evaluate', run_name='__main__')\n")
    p = run_python(tmp_path, "evaluate.py", "--workdir=cli", "--noplots")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.splitlines()[-1] == "frozen at exit: True", p.stdout
