"""eval.mode=async as a user meets it, from the CLI in a temp cwd with their own NNX model
(model.factory) and data module: the training command starts its evaluator beside itself,
and early stopping and the plateau decide from the eval of a FIXED earlier evaluation
point (eval.async_lag), so the same command killed by `debug.faults=kill@N` and rerun
(resumed), and the same command run again with eval.async_evaluator=external and `jtrain
evaluate --follow` started by hand once the run says it waits, stop at the same step with
the same best step and the same final state hash; the stop step is the one the logged
evals imply at that lag. `jtrain evaluate --follow` on a run trained in sync mode writes
one eval record per checkpoint into its metrics.jsonl, with its step, and agrees with the
run's own eval of its last step. Best-k keeping ranks the applied evals: the best one's
checkpoint is kept."""

import json
import queue
import subprocess
import sys
import threading
import time

import pytest
from journey import copy_project, metric_by_step, run_python, user_env

EVERY, LAG, PATIENCE = 2, 2, 2

CONFIG = f'''
from jtrain.config import defaults


def get_config():
    c = defaults(model="user")
    c.model.factory = "nnx_mlp:make"
    c.seed = 0
    c.total_steps = 40
    c.data.source = "nnx_mlp:data"
    c.data.val_fraction = 0.25
    c.data.batch_size = 8
    c.optim.lr = 0.02
    c.optim.warmup_steps = 0
    c.eval.every_steps = {EVERY}
    c.eval.mode = "async"
    c.eval.async_lag = {LAG}
    c.early_stop.monitor = "eval/loss"
    c.early_stop.patience = {PATIENCE}
    c.early_stop.min_delta = 0.01
    c.plateau.monitor = "eval/loss"
    c.plateau.patience = 0
    c.plateau.min_delta = 0.03
    c.checkpoint.every_steps = 1000
    c.checkpoint.max_to_keep = 1
    c.log.every_steps = 2
    c.log.writers = ("jsonl",)
    return c
'''


TRAIN = ("-m", "jtrain.main", "--config=cfg.py")


def _summary(path):
    return json.loads((path / "summary.json").read_text())


def _expected_stop(cfg_text: str, evals: dict) -> int:
    """The stop step the logged evals imply: early stopping fed the evals in step order;
    the point where it stops plus the lag."""
    from jtrain.control import monitors

    ns: dict = {}
    exec(cfg_text, ns)
    cfg = ns["get_config"]()
    early = monitors.EarlyStopping(cfg.early_stop)
    for step in sorted(evals):
        if early.update(step, {"eval/loss": evals[step]}):
            return step + LAG * EVERY
    return cfg.total_steps


@pytest.fixture(scope="module")
def child_run(tmp_path_factory):
    """The config's run with its child evaluator: (the user's directory, its process)."""
    tmp_path = tmp_path_factory.mktemp("async")
    copy_project(tmp_path, "nnx_mlp")
    (tmp_path / "cfg.py").write_text(CONFIG)
    first = run_python(tmp_path, *TRAIN, "--workdir=runs/a")
    assert first.returncode == 0, first.stderr[-3000:]
    return tmp_path, first


def test_async_eval_decides_the_same_on_a_resume(child_run):
    """Killed and rerun (resumed): the same stop step, best step and state as the run
    that was not killed. (The same command run again fresh, with the evaluator started
    by hand: test_an_external_evaluator_started_later_decides_like_the_child.)"""
    tmp_path, first = child_run
    train = TRAIN
    a = _summary(tmp_path / "runs/a")
    assert a["stopped_by"] == "early_stop", a.get("message")
    evals = metric_by_step(tmp_path / "runs/a", "eval/loss")
    assert a["step"] == _expected_stop(CONFIG, evals)
    # every evaluation point up to the stop, each once, with its own step
    assert sorted(evals) == list(range(EVERY, a["step"] + 1, EVERY))
    assert f"(async, applied at step {2 * LAG * EVERY})" in first.stdout + first.stderr

    kill_at = a["step"] - EVERY - 1
    killed = run_python(tmp_path, *train, "--workdir=runs/c",
                        f"--config.debug.faults=kill@{kill_at}")
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = run_python(tmp_path, *train, "--workdir=runs/c",
                         f"--config.debug.faults=kill@{kill_at}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step " in resumed.stdout + resumed.stderr
    c = _summary(tmp_path / "runs/c")
    assert ((c["step"], c["best_step"], c["state_sha256"])
            == (a["step"], a["best_step"], a["state_sha256"]))
    assert metric_by_step(tmp_path / "runs/c", "eval/loss") == evals
    # best-k keeping (checkpoint.keep_top_k=1 beside max_to_keep=1) ranked the evals
    # applied by the last save: the best of them is kept, in both runs
    applied = [(v, -s) for s, v in evals.items() if s <= a["step"] - LAG * EVERY]
    for run in "ac":
        assert (tmp_path / f"runs/{run}/checkpoints/{-min(applied)[1]}").is_dir()
    # the child evaluator ran at JTRAIN_EVAL_NICE's default, on every CPU (JTRAIN_EVAL_CPUS unset)
    log = (tmp_path / "runs/a/evals/evaluator.log").read_text().splitlines()
    assert log[0] == "jtrain: evaluator: nice 19", log[:3]


def _lines(proc):
    """The lines `proc` prints, read in a thread: (queue, thread)."""
    lines: queue.Queue = queue.Queue()

    def read():
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return lines


def _until(lines, text: str | None, timeout: float = 240) -> list[str]:
    """The lines up to the first one containing `text` (AssertionError without it);
    `text` None: up to the end of the output."""
    seen, end = [], time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line is None:
            if text is None:
                return seen
            break
        seen.append(line)
        if text is not None and text in line:
            return seen
    raise AssertionError(f"no line with {text!r}; the run said: {seen[-20:]}")


def test_an_external_evaluator_started_later_decides_like_the_child(child_run):
    """eval.async_evaluator=external: the run says once that it waits for the eval of the
    first point it applies and waits (no exit, no error); `jtrain evaluate --follow`
    started then lets it finish with the child-mode run's stop step, best step and state."""
    tmp_path, _ = child_run
    a = _summary(tmp_path / "runs/a")
    train = subprocess.Popen([sys.executable, *TRAIN, "--workdir=runs/e",
                              "--config.eval.async_evaluator=external"],
                             cwd=tmp_path, env=user_env(), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        lines = _lines(train)
        said = _until(lines, "jtrain: waiting for the eval of step")[-1]
        assert said.startswith(f"jtrain: waiting for the eval of step {EVERY} "
                               "(eval.async_evaluator=external): the run goes on when "
                               "`jtrain evaluate --follow "), said
        assert said.split("--follow ")[1].split("`")[0].endswith("runs/e")
        time.sleep(2)
        assert train.poll() is None  # it waits for the evaluator
        assert not list((tmp_path / "runs/e").glob("evals/*.json"))
        follow = run_python(tmp_path, "-m", "jtrain.evaluate", "--follow", "runs/e")
        assert follow.returncode == 0, follow.stderr[-3000:]
        assert train.wait(timeout=300) == 0
    finally:
        if train.poll() is None:
            train.kill()
            train.wait()
    rest = _until(lines, None, timeout=30)
    assert not any("waiting for the eval" in line for line in rest)  # said once
    assert f"jtrain: stopped early at step {a['step']} by early_stop" in "\n".join(rest)
    assert "jtrain: follow: the run finished; evaluated " in follow.stdout
    e = _summary(tmp_path / "runs/e")
    assert (e["stopped_by"], e["step"], e["best_step"], e["state_sha256"]) == \
        (a["stopped_by"], a["step"], a["best_step"], a["state_sha256"])
    assert metric_by_step(tmp_path / "runs/e", "eval/loss") == \
        metric_by_step(tmp_path / "runs/a", "eval/loss")


def test_evaluate_follow_on_a_sync_run(tmp_path):
    copy_project(tmp_path, "nnx_mlp")
    (tmp_path / "cfg.py").write_text(CONFIG)
    train = ["-m", "jtrain.main", "--config=cfg.py", "--workdir=runs/s",
             "--config.eval.mode=sync", "--config.eval.every_steps=0",
             "--config.early_stop.monitor=", "--config.plateau.monitor=",
             # decay_steps: the 40-step runs' schedule, so their compiled step serves it
             "--config.total_steps=6", "--config.optim.decay_steps=40",
             "--config.checkpoint.every_steps=2",
             "--config.checkpoint.max_to_keep=5"]
    assert run_python(tmp_path, *train).returncode == 0
    own = metric_by_step(tmp_path / "runs/s", "eval/loss")
    assert list(own) == [6]  # the run's own eval: its last step only
    follow = run_python(tmp_path, "-m", "jtrain.evaluate", "--follow", "runs/s")
    assert follow.returncode == 0, follow.stderr[-3000:]
    assert "jtrain: follow: the run finished; evaluated 3 checkpoints" in follow.stdout
    records = [json.loads(line) for line in
               (tmp_path / "runs/s/metrics.jsonl").read_text().splitlines()]
    followed = [r for r in records if "eval/loss" in r]
    assert [r["step"] for r in followed] == [6, 2, 4, 6]  # the run's, then the follower's
    assert followed[-1]["eval/loss"] == own[6]
