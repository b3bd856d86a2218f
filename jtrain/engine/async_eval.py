"""eval.mode=async: evaluation in a second process, decisions at a fixed lag.

The evaluator (`follow`, the command `jtrain evaluate --follow WORKDIR`) watches the run's
finished checkpoints (a manifest written last: never a half-written one), evaluates each
once and writes WORKDIR/evals/<step>.json whole. It works for any run: for a run in
eval.mode=sync it also appends the eval metrics to metrics.jsonl with their step; for an
async run the training process writes them, when it applies them.

The training side (`AsyncEvals`): every evaluation point is saved (and held: the keep
policy never deletes it before its eval was applied). At evaluation point k (step s, a
multiple of eval.every_steps) the loop applies the eval of point k - eval.async_lag
(step s - lag * every_steps) through the same decision path as a sync eval (early
stopping, the plateau factor, on_eval, the best-k registry), waiting for it only when
the evaluator is further behind. Which eval a decision uses depends on the step alone,
never on how fast the evaluator was, so a rerun or a resume decides the same. At the end
of the run (the last step, or an early stop) the evals not yet applied are waited for and
recorded (history, best step, metrics.jsonl) without deciding anything more.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import threading
import time
from typing import Callable

import jax

from jtrain.errors import ConfigError, EvaluateError, env_int
from jtrain.observe import jsonl, layout, runfiles

PARENT_ENV = "JTRAIN_EVAL_PARENT"  # the training process of a child evaluator
# Settings of the machine, not of the run (jtrain.errors.env_int): the child evaluator's
# nice value (0-19, default 19) and how many CPUs it is pinned to (0 = all).
NICE_ENV = "JTRAIN_EVAL_NICE"
CPUS_ENV = "JTRAIN_EVAL_CPUS"
CPU_IDS_ENV = "JTRAIN_EVAL_CPU_IDS"  # a child's CPUs, comma-separated ids
LOG = "evaluator.log"  # in WORKDIR/evals: the child evaluator's output


def check(cfg, remote: str | None = None, mixture: bool = False,
          from_python: tuple[str, ...] = ()) -> None:
    """What eval.mode=async does not cover: one ConfigError before the first step.
    `remote`: the workdir's URI when it is on an object store; `mixture`: the train data
    is a jtrain.data.Mixture given from Python (data.mixture is then empty);
    `from_python`: the names of jtrain.train's arguments passed as objects (model,
    train_data, ...), which config.json does not name."""
    if cfg.eval.mode != "async":
        return
    if cfg.eval.async_evaluator == "child":
        child_env()  # a bad JTRAIN_EVAL_NICE / _CPUS: one line before step 1
    if remote is not None:
        raise ConfigError("eval.mode", "async needs a local workdir (its evaluator follows "
                          f"the checkpoint folder); {remote} is on an object store")
    if jax.process_count() > 1:
        raise ConfigError("eval.mode", "async runs on one process only (the evaluator "
                                       "follows one workdir); use eval.mode=sync")
    if cfg.population.size > 1:
        raise ConfigError("eval.mode", "async does not evaluate a population's members "
                                       "(population.size > 1); "
                                       "use eval.mode=sync")
    if cfg.data.mixture or mixture:
        raise ConfigError("eval.mode", "async does not score a data.mixture's components; "
                                       "use eval.mode=sync")
    if from_python and cfg.eval.async_evaluator == "child":
        # The child rebuilds the run from config.json alone: it cannot import an object,
        # and with data passed from Python it would score the config's data instead.
        raise ConfigError("eval.async_evaluator", "the child evaluator rebuilds the run from "
                          f"config.json, but {', '.join(from_python)} came from Python; name "
                          "them in the config (model.factory, data.source, loss.fn, "
                          "step.factory) or set eval.async_evaluator=external and run "
                          "jtrain.evaluate.follow(workdir, model=..., loss_fn=..., data=...)")


def is_point(cfg, step: int) -> bool:
    """An evaluation point: a multiple of eval.every_steps, or the last step."""
    every = cfg.eval.every_steps
    return bool(every and step % every == 0) or step == cfg.total_steps


class AsyncEvals:
    """The training process's side: the held checkpoints, the child evaluator, the
    lagged results."""

    def __init__(self, cfg, workdir: str, ckpt):
        self.cfg, self.workdir, self.ckpt = cfg, workdir, ckpt
        self.proc: subprocess.Popen | None = None
        self.told = False  # the external evaluator's wait said once
        history = ckpt.control.eval_history
        self.applied = int(history[-1]["step"]) if history else 0
        ckpt.held = {s for s in ckpt.all_steps() if s > self.applied and is_point(cfg, s)}

    def start(self) -> None:
        """The child evaluator (eval.async_evaluator=child), its output in
        WORKDIR/evals/evaluator.log."""
        if self.cfg.eval.async_evaluator != "child" or self.proc is not None:
            return
        os.makedirs(os.path.join(self.workdir, layout.EVALS), exist_ok=True)
        with layout.open_append(os.path.join(self.workdir, layout.EVALS, LOG)) as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jtrain.evaluate", "--follow", self.workdir],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **child_env()})

    def due(self, step: int) -> int | None:
        """The eval step applied at `step`: step - async_lag * every_steps, at a multiple
        of eval.every_steps; None elsewhere (and before the lag has passed)."""
        every = self.cfg.eval.every_steps
        if not every or step % every:
            return None
        target = step - self.cfg.eval.async_lag * every
        return target if target > 0 else None

    def saved(self, step: int) -> None:
        """Checkpoint `step` was saved: an evaluation point is held until applied."""
        if is_point(self.cfg, step) and step > self.applied:
            self.ckpt.held.add(step)

    def take(self, step: int, beat: Callable[[], None],
             say: Callable[[str], None] = print) -> dict:
        """The eval of checkpoint `step` as a history record {"step", "eval/...": v},
        waited for (`beat`: the watchdog's, while waiting); its hold released. With
        eval.async_evaluator=external the first wait of the run is said in one line
        (`say`): no evaluator may be running, and the run waits for one."""
        while (record := layout.read_eval_result(self.workdir, step)) is None:
            if self.proc is None and not self.told:
                self.told = True
                say(f"jtrain: waiting for the eval of step {step} "
                    "(eval.async_evaluator=external): the run goes on when `jtrain "
                    f"evaluate --follow {self.workdir}` has evaluated it; start that "
                    "command if it is not running")
            if self.proc is not None and self.proc.poll() is not None:
                raise EvaluateError(
                    f"eval.mode=async: the evaluator process ended (exit code "
                    f"{self.proc.returncode}) before step {step} was evaluated; its output "
                    f"is in WORKDIR/{layout.EVALS}/{LOG}")
            folder = os.path.join(self.ckpt.directory, str(step))
            if not (os.path.isdir(folder) or glob.glob(folder + ".*")) \
                    and not self._saved_after_wait(folder):  # nor in flight
                raise EvaluateError(f"eval.mode=async: checkpoint {step} is gone before it "
                                    "was evaluated")
            beat()
            time.sleep(0.02)
        if "skipped" in record:
            raise EvaluateError(f"eval.mode=async: the evaluator could not read checkpoint "
                                f"{step}: {record['skipped']}")
        self.ckpt.held.discard(step)
        self.applied = max(self.applied, step)
        return {"step": step, **{k: float(v) for k, v in record["metrics"].items()}}

    def _saved_after_wait(self, folder: str) -> bool:
        """Whether `folder` exists once the run's saves in flight are finished (an async
        save may not have made its temporary folder yet, on a loaded machine)."""
        wait = getattr(self.ckpt, "wait", None)
        if wait is not None:
            wait()
        return os.path.isdir(folder)

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def child_env() -> dict[str, str]:
    """What a child evaluator is told: its training process, its nice value, its CPUs
    (`confine` applies them in the child before JAX starts its threads); a UsageError
    naming a bad JTRAIN_EVAL_NICE / JTRAIN_EVAL_CPUS."""
    env = {PARENT_ENV: str(os.getpid()), NICE_ENV: str(env_int(NICE_ENV, 19, 0, 19))}
    cpus = evaluator_cpus(env_int(CPUS_ENV, 0, 0, 1 << 16))
    if cpus:
        env[CPU_IDS_ENV] = ",".join(map(str, cpus))
    return env


def evaluator_cpus(count: int) -> list[int] | None:
    """JTRAIN_EVAL_CPUS=count: the last `count` of the CPUs this process may use; None (no
    pinning) for 0, for `count` >= all of them, or where affinity is not supported."""
    if not count or not hasattr(os, "sched_getaffinity"):
        return None
    mine = sorted(os.sched_getaffinity(0))
    return mine[-count:] if count < len(mine) else None


def confine() -> str:
    """A child evaluator, before JAX starts: every thread of this process gets the nice
    value and the CPUs its training process chose (NICE_ENV, CPU_IDS_ENV; the threads
    started later inherit them, XLA:CPU sizes its thread pool to the CPUs). Returns
    what it applied, in words ("" where nothing: no such variables, not Linux).

    The CPU set is the one lever on the evaluator's threads: with jaxlib 0.10,
    `--xla_cpu_multi_thread_eigen=false` left a jitted matmul running on two of XLA's
    pool threads, and `--intra_op_parallelism_threads` is not an XLA flag (XLA_FLAGS
    refuses it), while under a one-CPU affinity the same work ran on one thread."""
    from jtrain.checkpoint import policy

    if not os.environ.get(PARENT_ENV):  # not a child evaluator (a training process)
        return ""
    nice, cpus = os.environ.get(NICE_ENV), os.environ.get(CPU_IDS_ENV)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux
        return ""
    done = []
    if nice:
        policy.lower_priority(int(nice), tids)
        done.append(f"nice {os.getpriority(os.PRIO_PROCESS, 0)}")
    if cpus and hasattr(os, "sched_setaffinity"):
        for t in tids:
            try:
                os.sched_setaffinity(t, {int(c) for c in cpus.split(",")})
            except OSError:  # a thread that ended, a CPU gone meanwhile
                pass
        done.append(f"CPUs {','.join(map(str, sorted(os.sched_getaffinity(0))))}")
    return ", ".join(done)


def for_run(cfg, workdir: str, ckpt, resumed_from: int | None) -> AsyncEvals | None:
    """The run's AsyncEvals (None in eval.mode=sync; `check` ran at start-up). On a
    resume, metrics.jsonl first drops the eval records the restored checkpoint had not
    applied yet: they are applied (and written) again, at the same steps."""
    if cfg.eval.mode != "async":
        return None
    evals = AsyncEvals(cfg, workdir, ckpt)
    path = os.path.join(workdir, "metrics.jsonl")
    if resumed_from is not None and os.path.exists(path):
        jsonl.drop_evals_after(path, evals.applied)
    return evals


# -- the evaluator: jtrain evaluate --follow WORKDIR ---------------------------------------
def follow(workdir: str, *, poll_s: float = 0.2, say: Callable[[str], None] = print,
           model=None, loss_fn=None, data="eval", tx=None) -> list[int]:
    """Evaluates every new finished checkpoint of the run at `workdir` once (an async
    run's: its evaluation points), writing WORKDIR/evals/<step>.json (and, for a run not
    in eval.mode=async, the metrics into metrics.jsonl with their step), until the run's
    summary.json says it finished at its newest checkpoint (a child evaluator: until
    its training process ends it or is gone). Returns the steps evaluated. From Python, `model`
    (a module or a jtrain.step.Step), `loss_fn` and `data` (the eval data, anything
    jtrain.train accepts as eval_data) are what the run was given as objects.

    Examples:
        ```python
        import threading

        import jtrain
        import jtrain.evaluate

        cfg = {"total_steps": 20, "eval": {"mode": "async", "every_steps": 10,
                                           "async_evaluator": "external"}}
        t = threading.Thread(target=jtrain.evaluate.follow, args=("runs/a",),
                             kwargs={"model": Net(), "data": (x_val, y_val)})
        t.start()
        jtrain.train(cfg, "runs/a", model=Net(), train_data=(x, y),
                     eval_data=(x_val, y_val))
        t.join()
        ```
    """
    from jtrain.engine import checkpoint_eval

    confined = confine()  # a child evaluator: nice value and CPUs before JAX starts
    if confined:
        say(f"jtrain: evaluator: {confined}")
    opened = checkpoint_eval.open_run(workdir, model=model, loss_fn=loss_fn, data=data,
                                      eval_defaults=False, tx=tx)
    workdir, cfg = opened.workdir, opened.cfg
    parent = os.environ.get(PARENT_ENV)
    if parent:
        _exit_with(int(parent))
    own = cfg.eval.mode != "async"  # who writes the metrics into metrics.jsonl
    done = layout.eval_result_steps(workdir)
    evaluated: list[int] = []
    while True:
        steps = opened.reader.all_steps()
        todo = [s for s in steps if s not in done and (own or is_point(cfg, s))]
        for step in todo:
            record = _evaluate(opened, step, say)
            layout.write_eval_result(workdir, step, record)
            done.add(step)
            if "metrics" in record:
                evaluated.append(step)
                if own:
                    _append_metrics(workdir, step, record["metrics"])
        if not todo:
            # A child evaluator ends with its training process (close, or _exit_with):
            # a summary.json there may be a stopped session's, which the resumed
            # session it serves goes on from.
            if not parent and _finished(workdir, steps):
                return evaluated
            time.sleep(poll_s)


def _evaluate(opened, step: int, say) -> dict:
    """{"step", "metrics", "num_examples"}, or {"step", "skipped"} for a checkpoint
    deleted under the evaluator (a sync run's keep policy)."""
    from flax import linen as nn

    from jtrain import mesh as mesh_lib
    from jtrain.engine import evaluation

    cfg, b = opened.cfg, opened.build
    try:
        state = opened.reader.restore(step, b.abstract_with_shardings())[0]
    except Exception:
        if os.path.isdir(os.path.join(opened.reader.directory, str(step))):
            raise
        why = "deleted before it was evaluated (the run's checkpoint keep policy)"
        say(f"jtrain: warning: checkpoint {step} was {why}; skipped")
        return {"step": step, "skipped": why}
    local_batch = (cfg.eval.batch_size or cfg.data.batch_size) // jax.process_count()
    with jax.set_mesh(b.mesh), nn.logical_axis_rules(mesh_lib.LOGICAL_RULES):
        result = evaluation.evaluate_weights(
            b.eval_step, state, opened.source, weights=opened.weights, mesh=b.mesh,
            local_batch=local_batch, max_batches=cfg.eval.num_batches, spec=b.eval_spec,
            tail_step=b.eval_tail)
    say(evaluation.format_line(step, result))
    return {"step": step, "num_examples": result.num_examples,
            "metrics": {k: jsonl.json_float(v) for k, v in result.scalars.items()}}


def _append_metrics(workdir: str, step: int, metrics: dict) -> None:
    """One metrics.jsonl record, appended in one write (the training process may be
    appending its own)."""
    import json

    line = json.dumps({"step": step, "time": time.time(), **metrics}) + "\n"
    with layout.open_append(os.path.join(workdir, "metrics.jsonl")) as f:
        f.write(line)


def _finished(workdir: str, steps: list[int]) -> bool:
    """summary.json names the newest checkpoint: the run ended there (a summary.json
    that is not a JSON object is one WorkdirError: it is written whole, never torn)."""
    try:
        step = runfiles.read_object(os.path.join(workdir, "summary.json")).get("step")
    except FileNotFoundError:
        return False
    return bool(steps) and step == max(steps)


def _exit_with(parent: int) -> None:
    """A child evaluator ends when its training process is gone (killed included)."""
    def watch():
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="jtrain-eval-parent").start()
