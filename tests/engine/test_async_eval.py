"""eval.mode=async's internals, in process (the journey: tests/journeys/
test_async_eval_journey.py): which eval a step applies, the resumed run's metrics.jsonl
(each eval once after a resume behind evals the killed session wrote),
a checkpoint deleted under the evaluator, a save renamed into place while it lists, the
held checkpoints the keep policy keeps, the child evaluator's nice value and CPUs."""

import json
import os
import shutil
import types

import pytest

import jtrain
from jtrain import config as config_lib
from jtrain import errors
from jtrain.checkpoint import policy
from jtrain.engine import async_eval
from jtrain.observe import jsonl, layout
from journey import copy_project
from projects import mydata
from projects.linen_classifier import Net


def _cfg(every=5, lag=2, total=23):
    cfg = config_lib.defaults()
    cfg.eval.every_steps, cfg.eval.async_lag, cfg.total_steps = every, lag, total
    cfg.eval.mode = "async"
    return cfg


def _evals(cfg, history=()):
    ckpt = types.SimpleNamespace(control=types.SimpleNamespace(eval_history=list(history)),
                                 all_steps=lambda: [5, 10, 15], held=set(), directory="")
    return async_eval.AsyncEvals(cfg, "unused", ckpt)


def test_the_applied_eval_is_the_step_minus_the_lag_and_nothing_else():
    evals = _evals(_cfg())
    assert [evals.due(s) for s in (5, 10, 11, 15, 20, 23)] == [None, None, None, 5, 10, None]
    assert evals.ckpt.held == {5, 10, 15}  # a fresh run: every saved point waits
    resumed = _evals(_cfg(), history=[{"step": 5}])
    assert resumed.ckpt.held == {10, 15} and resumed.applied == 5
    resumed.saved(20), resumed.saved(21), resumed.saved(23)  # 23: the last step
    assert resumed.ckpt.held == {10, 15, 20, 23}


def test_the_keep_policy_keeps_held_checkpoints():
    owner = types.SimpleNamespace(
        cfg=types.SimpleNamespace(max_to_keep=1, keep_every_steps=0, keep_top_k=0,
                                  mode="min"),
        control=types.SimpleNamespace(metric_registry={}), held={10})
    infos = [types.SimpleNamespace(step=s) for s in (5, 10, 15)]
    assert policy.KeepPolicy(owner).should_preserve(infos, context=None) == [False, True, True]


def test_a_resume_drops_the_eval_records_it_applies_again(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 5, "train/loss": 1.0}, {"step": 5, "eval/loss": 2.0},
            {"step": 10, "train/loss": 0.5}, {"step": 10, "eval/loss": 1.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    jsonl.drop_evals_after(str(path), 5)
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:3]


@pytest.mark.slow  # a child evaluator: a process
def test_a_run_resumed_at_its_last_step_returns_each_eval_once(tmp_path, monkeypatch):
    """A finished async run started again ends at once; its TrainResult.history holds the
    last eval once (the held eval the rest records, not again from the checkpoint)."""
    copy_project(tmp_path, "nnx_mlp")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = {"total_steps": 4, "seed": 0, "model": {"name": "user", "factory": "nnx_mlp:make"},
              "data": {"source": "nnx_mlp:data", "batch_size": 8, "val_fraction": 0.25},
              "eval": {"every_steps": 2, "mode": "async", "async_lag": 1},
              "checkpoint": {"every_steps": 2}, "log": {"verbosity": 0, "writers": ("jsonl",)}}
    for _ in range(2):
        steps = [e["step"] for e in jtrain.train(config, "run").history]
        assert sorted(set(steps)) == [2, 4] and len(steps) == len(set(steps)), steps


@pytest.mark.slow  # seconds of CPU: the full suite runs it (tests/README.md)
def test_a_resumed_run_writes_each_eval_once(tmp_path):
    """Every 2 steps, lag 2: the eval of step 4 is applied (written) at step 8, that of
    step 6 at step 10. A session killed after step 10 and resumed from checkpoint 6 has
    both records in metrics.jsonl (steps <= 6) and writes them again: the resumed run
    drops them first. The killed session is a finished run's workdir less its
    checkpoints after 6 and its summary (a kill leaves a prefix of those records). The
    evaluator's results are in WORKDIR/evals already: the run reads them, none waits."""
    def train(workdir):
        config = {"total_steps": 12, "seed": 0, "data": {"batch_size": 8},
                  "eval": {"every_steps": 2, "mode": "async", "async_lag": 2,
                           "async_evaluator": "external"},
                  "checkpoint": {"every_steps": 2, "max_to_keep": 20},
                  "log": {"verbosity": 0, "writers": ("jsonl",)},
                  "optim": {"name": "adamw", "lr": 0.05, "schedule": "constant"}}
        jtrain.train(config, str(workdir), model=Net(), train_data=mydata.make(40, train=None))
        return [(r["step"], r["eval/loss"]) for r in
                jsonl.read_records(str(workdir / "metrics.jsonl")) if "eval/loss" in r]

    evals = [(s, s / 64) for s in range(2, 13, 2)]
    for s, v in evals:
        layout.write_eval_result(str(tmp_path / "a"), s, {"step": s, "num_examples": 2,
                                                          "metrics": {"eval/loss": v}})
    assert train(tmp_path / "a") == evals  # straight through
    shutil.copytree(tmp_path / "a", tmp_path / "c")
    for s in (8, 10, 12):
        shutil.rmtree(tmp_path / "c" / "checkpoints" / str(s))
    os.remove(tmp_path / "c" / "summary.json")
    assert train(tmp_path / "c") == evals


def test_a_save_not_yet_on_disk_is_waited_for_not_called_gone(tmp_path):
    """An async save that has not made its folder yet (a loaded machine) is waited for;
    only a step still missing after the saves in flight finish is gone."""
    def wait():  # the save in flight lands; the evaluator then writes its result
        os.makedirs(tmp_path / "checkpoints" / "6")
        layout.write_eval_result(str(tmp_path), 6, {"step": 6, "num_examples": 2,
                                                    "metrics": {"eval/loss": 0.5}})
    ckpt = types.SimpleNamespace(control=types.SimpleNamespace(eval_history=[]),
                                 all_steps=lambda: [], held={6}, wait=wait,
                                 directory=str(tmp_path / "checkpoints"))
    evals = async_eval.AsyncEvals(_cfg(total=6), str(tmp_path), ckpt)
    assert evals.take(6, lambda: None, say=lambda line: None) == {"step": 6,
                                                                   "eval/loss": 0.5}
    ckpt.wait = lambda: None
    with pytest.raises(errors.EvaluateError, match="checkpoint 7 is gone"):
        evals.take(7, lambda: None, say=lambda line: None)


def test_a_checkpoint_deleted_under_the_evaluator_is_reported_and_skipped(tmp_path):
    def gone(step, abstract):
        raise FileNotFoundError(step)

    lines = []
    opened = types.SimpleNamespace(
        cfg=None, reader=types.SimpleNamespace(directory=str(tmp_path), restore=gone),
        build=types.SimpleNamespace(abstract_with_shardings=lambda: None))
    record = async_eval._evaluate(opened, 7, lines.append)
    assert record == {"step": 7, "skipped": "deleted before it was evaluated (the run's "
                                            "checkpoint keep policy)"}
    assert lines == ["jtrain: warning: checkpoint 7 was deleted before it was evaluated "
                     "(the run's checkpoint keep policy); skipped"]


def test_async_mode_refuses_a_workdir_on_an_object_store():
    cfg = config_lib.resolve({"eval": {"mode": "async"}})
    async_eval.check(cfg)  # a local workdir, one process: fine
    try:
        async_eval.check(cfg, remote="s3://bucket/run")
    except config_lib.ConfigError as e:
        assert e.key == "eval.mode" and "s3://bucket/run" in str(e), e
    else:
        raise AssertionError("eval.mode=async with an s3:// workdir was not refused")
    async_eval.check(config_lib.resolve({}), remote="s3://bucket/run")  # sync: fine


def test_the_child_evaluator_gets_the_last_cpus_and_the_nice_value(monkeypatch):
    monkeypatch.setattr(async_eval.os, "sched_getaffinity", lambda pid: {3, 0, 2, 1})
    assert [async_eval.evaluator_cpus(n) for n in (0, 1, 2, 4, 9)] == \
        [None, [3], [2, 3], None, None]  # all of them or more: no pinning
    monkeypatch.setenv(async_eval.NICE_ENV, "5")
    monkeypatch.setenv(async_eval.CPUS_ENV, "1")
    env = async_eval.child_env()
    assert (env[async_eval.NICE_ENV], env[async_eval.CPU_IDS_ENV]) == ("5", "3")
    monkeypatch.setenv(async_eval.CPUS_ENV, "0")
    assert async_eval.CPU_IDS_ENV not in async_eval.child_env()
    monkeypatch.delenv(async_eval.NICE_ENV)
    assert async_eval.child_env()[async_eval.NICE_ENV] == "19"  # the default


@pytest.mark.parametrize("name, value", [("JTRAIN_EVAL_NICE", "20"),
                                         ("JTRAIN_EVAL_NICE", "low"),
                                         ("JTRAIN_EVAL_CPUS", "-1")])
def test_a_bad_evaluator_setting_is_one_line_before_the_first_step(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    cfg = _cfg()
    cfg.eval.mode = "async"
    with pytest.raises(errors.UsageError) as e:
        async_eval.check(cfg)
    assert str(e.value).startswith(f"{name}={value!r} in the environment: expected an "
                                   "integer in [0, "), str(e.value)


def test_confine_reaches_the_threads_xla_starts_afterwards():
    """In a fresh process, as a child evaluator starts: a thread already running, then
    confine(), then JAX; every thread (that one and XLA:CPU's pool) has the nice value
    and the one CPU."""
    import os
    import subprocess
    import sys

    cpu = max(os.sched_getaffinity(0))
    code = ("import json, os, threading, time\n"
            "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            "from jtrain.engine import async_eval\n"
            "said = async_eval.confine()\n"
            "import jax.numpy as jnp\n"
            "(jnp.ones((64, 64)) @ jnp.ones((64, 64))).block_until_ready()\n"
            "tids = [int(t) for t in os.listdir('/proc/self/task')]\n"
            "print(json.dumps([said, len(tids), sorted({os.getpriority(os.PRIO_PROCESS, t)"
            " for t in tids}), sorted({c for t in tids for c in os.sched_getaffinity(t)})]))")
    env = {**os.environ, async_eval.NICE_ENV: "7", async_eval.CPU_IDS_ENV: str(cpu),
           async_eval.PARENT_ENV: str(os.getpid()),
           "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    said, threads, nices, cpus = json.loads(out.stdout.splitlines()[-1])
    assert said == f"nice 7, CPUs {cpu}"
    assert threads > 3 and nices == [7] and cpus == [cpu]


def test_a_save_renamed_into_place_while_the_evaluator_lists_is_passed_over(tmp_path,
                                                                           monkeypatch):
    """The evaluator scans a live run's checkpoints: an entry listed and then renamed
    (a finished save) or deleted (the keep policy) before its stat is left for the next
    scan, not an error that ends the evaluator."""
    from jtrain.checkpoint import integrity

    (tmp_path / "10").mkdir()
    moving = tmp_path / f"20{integrity.TMP_MARK}1"
    moving.mkdir()
    real_lstat = integrity.os.lstat

    def lstat(path):
        if str(path) == str(moving):
            raise FileNotFoundError(path)  # renamed to 20 after the listing
        return real_lstat(path)

    monkeypatch.setattr(integrity.os, "lstat", lstat)
    assert integrity.scan(str(tmp_path)) == ([10], [], [])


def _small(mode, evaluator="child"):
    return {"total_steps": 4, "seed": 0, "data": {"batch_size": 8, "val_fraction": 0.0},
            "eval": {"every_steps": 2, "mode": mode, "async_evaluator": evaluator},
            "checkpoint": {"every_steps": 2, "max_to_keep": 20},
            "log": {"verbosity": 0, "writers": ("jsonl",)},
            "optim": {"name": "adamw", "lr": 0.05, "schedule": "constant"}}


def test_the_child_evaluator_with_objects_from_python_is_one_line_before_step_1(tmp_path):
    """The child rebuilds the run from config.json: a model, or data, passed from
    Python is refused before any step, naming what came from Python."""
    from jtrain import errors

    given = {"model": {"model": Net()},
             "train_data": {"train_data": mydata.make(40, train=None)}}
    for name, kwargs in given.items():
        workdir = tmp_path / name
        try:
            jtrain.train(_small("async"), str(workdir), **kwargs)
        except errors.ConfigError as e:
            line = errors.render(e)
        else:
            raise AssertionError(f"{name} from Python with the child evaluator ran")
        assert line.startswith("jtrain: config error: eval.async_evaluator: ") and \
            "\n" not in line and f"but {name} came from Python" in line, line
        assert "eval.async_evaluator=external" in line and "follow(" in line, line
        assert not (workdir / "checkpoints").exists()


def test_follow_scores_the_eval_data_given_from_python_as_a_sync_eval_did(tmp_path):
    """A sync run's evals at steps 2 and 4 against follow(model=, data=) over its
    checkpoints: the same data, so the same numbers (the external follower of
    docs/guide/evaluation.md, given the run's model and eval data)."""
    rows = mydata.make(56, train=None)
    train = {k: v[:40] for k, v in rows.items()}
    ev = {k: v[40:] for k, v in rows.items()}
    result = jtrain.train(_small("sync"), str(tmp_path), model=Net(), train_data=train,
                          eval_data=ev)
    synced = {r["step"]: r["eval/loss"] for r in result.history}
    assert sorted(synced) == [2, 4]
    assert async_eval.follow(str(tmp_path), model=Net(), data=ev, say=lambda _: None) == [2, 4]
    for step in (2, 4):
        got = layout.read_eval_result(str(tmp_path), step)
        assert got["metrics"]["eval/loss"] == synced[step], (step, got, synced)
        assert got["num_examples"] == 16
