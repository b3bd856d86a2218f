"""The training loop: dispatch steps, drain them in order, evaluate, decide, save.

Per step: the batch (already on the devices) goes into the jitted step; at most
`max_steps_in_flight` steps run ahead of the host. Draining a step reads its in-graph
status (a skipped update becomes a warning and a skip-ledger entry, a halt ends the run
with `NonFiniteError`, exit 4) and, on log steps, its metrics.

At an eval step (every `eval.every_steps`, and always the last step) the loop evaluates
*before* it saves, so the checkpoint of that step holds its eval (best-k registry,
history, early-stopping state); then early stopping, the plateau factor and `on_eval`
decide (jtrain.control.decide), and an eval that enters the top k saves its step
(checkpoint.save_on_best). With eval.mode=async (engine.async_eval) the loop evaluates
nothing: it saves each evaluation point for the evaluator process and, at a multiple of
eval.every_steps, applies the eval of eval.async_lag points earlier through the same
decision path (`_decide`). Before every save all steps in flight are drained (a halt is
never checkpointed) and the params are checked finite.

With `spike.zscore`, a drained step whose train loss spikes makes the loop roll back to
the newest checkpoint before it (`_rollback`) before it evaluates, saves or goes on.

The train state passes through module-level functions that return it (a drain may roll
it back, an eval may set its learning-rate factor); the host's bookkeeping (evals, the
steps in flight, the stop) is the session's (`_Session`). No closure holds the state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections import deque
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jtrain import checkpoint, multihost
from jtrain import config as config_lib
from jtrain import control as control_lib
from jtrain import state as state_lib
from jtrain import step as step_lib
from jtrain.control import decide as decide_lib
from jtrain.control.faults import before_step, fault_point, perturb
from jtrain.data import RunData
from jtrain.data.prefetch import DevicePrefetch
from jtrain.engine import async_eval, evaluation as evaluator
from jtrain.engine import population as population_lib
from jtrain.engine import summary as summary_lib
from jtrain.engine.assemble import Build
from jtrain.errors import NonFiniteError
from jtrain.observe import goodput as goodput_lib, hashes as hashes_lib
from jtrain.observe import startup as startup_lib
from jtrain.observe.outputs import Outputs


@dataclasses.dataclass(kw_only=True)
class Run:
    """What `train()` sets up for the loop."""
    workdir: str
    build: Build
    state: state_lib.TrainState  # restored or fresh
    data: RunData  # sources, eval plan
    train_iter: DevicePrefetch  # the next batches, on the devices
    ckpt: checkpoint.Checkpointer | checkpoint.Tiers  # Tiers: checkpoint.local_dir
    out: Outputs
    resumed_from: int | None  # the restored step; None: a fresh start or init_from
    decisions: decide_lib.Decisions
    watchdog: control_lib.Watchdog  # a no-op when off
    stopper: control_lib.Stopper  # signals -> stop after a step
    startup: startup_lib.Startup  # phase timings, compile record, the precompile thread
    goodput: goodput_lib.Ledger  # where the session's seconds go (goodput.jsonl)
    record: dict = dataclasses.field(default_factory=dict)  # run.json (its "decided")
    async_evals: async_eval.AsyncEvals | None = None  # eval.mode=async; None: sync
    lm_tasks: Callable | None = None  # eval.lm_tasks (engine.lm_tasks.Scorer); None: none

    def close(self):
        self.watchdog.pause()
        if self.async_evals is not None:
            self.async_evals.close()
        if self.startup.precompile is not None:
            self.startup.precompile.join()  # stopped before the first step: let it finish
        self.out.close()
        self.ckpt.close()
        self.train_iter.close()
        self.goodput.close()  # finished sessions closed it; a halt or an error had not


@dataclasses.dataclass
class _Session:
    """The loop's bookkeeping for this process's part of the run."""
    history: list = dataclasses.field(default_factory=list)  # evals
    train_history: list = dataclasses.field(default_factory=list)  # log steps
    stop_reason: str | None = None
    stopped_by: str | None = None
    rollback: tuple | None = None  # (spike step, z-score) found while draining
    window: tuple = (0.0, 0)  # (sum, count) of the finite train losses since the last log
    saved: int | None = None  # the last step this session saved
    stored: dict | None = None  # summary.json of a run that had finished already
    hashes: hashes_lib.Recorder | None = None  # debug.hash_every_steps (hashes.jsonl)
    pending: deque = dataclasses.field(default_factory=deque)  # (step, metrics): in flight
    config_hash: str = ""  # --debug_multihost's (the config is fixed)
    set_factor: Callable | None = None  # jit(state, factor) -> state (plateau, callbacks)
    save_asked: bool = False  # a rule asked for a checkpoint of this step
    last_drained: int = 0  # the newest step drained
    all_finite: Callable | None = None  # jit(params) -> bool (before a save)


def run_loop(cfg, run: Run):
    """(state, session), which `train()` turns into a TrainResult; the state goes through
    the functions below, each returning it (a drain may roll it back, a fault poison it)."""
    state, total = run.state, cfg.total_steps
    step = start = int(jax.device_get(state.step))
    session = _start(cfg, run, start)
    for step in range(start + 1, total + 1 if not session.stopped_by else start + 1):
        first = step == start + 1  # it compiles: timed, with its own allowance
        batch, timing = _next_batch(cfg, run, session, step, first)
        state = before_step(step, state, run.out.writer)  # debug.faults: nan, writer_fail
        with _compiling(run.startup, first):
            state, metrics = run.build.train_step(state, batch)
            if first:
                jax.block_until_ready(metrics)
        state = _dispatched(cfg, run, session, state, step, metrics, timing, first)
        best = False
        if run.async_evals is not None:  # the eval of an earlier point, at a fixed lag
            state = _apply_lagged(cfg, run, session, state, step)
            best = async_eval.is_point(cfg, step)  # saved: the evaluator reads it
        elif (cfg.eval.every_steps and step % cfg.eval.every_steps == 0) or step == total:
            state, best = _evaluate_and_decide(cfg, run, session, state, step)
        if run.stopper.should_stop(step):  # SIGTERM/SIGINT, the same step on all processes
            session.stopped_by = session.stopped_by or run.stopper.signal_name
        if session.stopped_by or best or session.save_asked or step == total \
                or run.ckpt.due(step):
            state = _save(cfg, run, session, state, step)
        if session.stopped_by:
            break
    state = _drained(cfg, run, session, state)
    if run.async_evals is not None and session.stopped_by in (None, "early_stop", "on_eval",
                                                              "callback"):
        _record_rest(cfg, run, session)  # the evals not applied yet: recorded, not decided
    run.watchdog.beat("final save")
    if step == total == start:  # resumed at the end: its eval is in the checkpoint
        session.stored = summary_lib.stored_summary(run.workdir, state)
        last = [e for e in run.ckpt.control.eval_history if e.get("step") == total]
        if not any(e.get("step") == total for e in session.history):  # async: recorded
            session.history += last[-1:] or session.history[-1:] or \
                run.stopper.interruptible(_evaluate, cfg, run, state, total)
    if run.ckpt.latest_step() != step and not (step == start and session.stopped_by):
        state = _save(cfg, run, session, state, step)
    with run.goodput.phase("checkpoints"):
        run.ckpt.wait()  # a failed write ends the run with an error, before any summary
    run.watchdog.pause()
    return state, session


def _start(cfg, run: Run, start: int) -> _Session:
    """This session's bookkeeping, its jitted helpers, the heartbeat's first notes; a
    signal during start-up means nothing new to save."""
    session = _Session(
        hashes=hashes_lib.Recorder(
            run.workdir, cfg.debug.hash_every_steps, primary=jax.process_index() == 0,
            resumed_step=run.resumed_from, mesh=run.build.mesh,
            examples_of=lambda s: run.decisions.indices_of(run.decisions.batch_of(s))),
        set_factor=jax.jit(set_lr_factor, donate_argnums=0,
                           out_shardings=run.build.shardings),
        all_finite=jax.jit(params_finite),
        config_hash=(config_lib.config_hash(cfg) if cfg.distributed.debug_every_steps
                     else ""))
    if run.stopper.signal_name is not None:  # a signal during start-up: nothing new to save
        session.stopped_by = run.stopper.signal_name
    multihost.heartbeat.note_step(start)
    multihost.heartbeat.note_checkpoint(run.ckpt.latest_step())
    return session


def set_lr_factor(state, factor):
    return state.replace(lr_factor=factor.astype(jnp.float32))


def params_finite(params):
    return jnp.all(jnp.asarray([jnp.isfinite(x).all() for x in jax.tree.leaves(params)]))


def _next_batch(cfg, run: Run, session: _Session, step: int, first: bool):
    """The step's bookkeeping (heartbeat, --debug_multihost, profiler, watchdog: the first
    step gets watchdog.first_timeout_s) and its batch, on the devices already
    (data.device_prefetch); (batch, (seconds waited for it, when it came))."""
    multihost.heartbeat.note_step(step)
    every = cfg.distributed.debug_every_steps
    if every and step % every == 0:  # --debug_multihost
        multihost.preflight.check_step(step, cfg, session.config_hash)
    run.out.profiler.before_step(step)
    run.watchdog.beat("first step" if first else "step",
                      allowance=cfg.watchdog.first_timeout_s if first else None)
    t0 = time.perf_counter()
    batch = next(run.train_iter)
    t1 = time.perf_counter()
    if first:
        fault_point("compile", delay=0.05)  # test-only: a signal while it compiles
    return batch, (t1 - t0, t1)


@contextlib.contextmanager
def _compiling(startup: startup_lib.Startup, first: bool):
    """The first step of this session is start-up's compile phase; a step compiled beside
    the state's init (compile.precompile) is joined first, its executable reused."""
    if not first:
        yield
        return
    with startup.phase("compile"):
        if startup.precompile is not None:
            startup.precompile.join()
        yield


def _dispatched(cfg, run: Run, session: _Session, state, step: int, metrics, timing,
                first: bool):
    """After a step's call: its timings (the first step's: the start-up line and perf's
    first-step record; compiles after it are recompiles, observe.compiles), the test-only
    perturbation, its state hash dispatched, recompiles said, the profiler; then it is in
    flight, and the oldest steps are drained beyond max_steps_in_flight."""
    waited, t1 = timing
    run.goodput.step_done(step, waited, first)
    if first:
        su = run.startup
        su.first_step()
        su.recorder.first_step_done()
        run.out.progress.message(su.line(su.cache_dir))
        run.out.perf.step_done(step, waited, time.perf_counter() - t1, metrics)
        run.out.perf.set_first(su.breakdown())
    else:
        run.out.perf.step_done(step, waited, time.perf_counter() - t1)
    state = perturb(step, state)  # JTRAIN_FAULT=noise:N, debug.faults nan; else a no-op
    session.hashes.dispatch(step, state)  # on the devices, fetched when drained
    _report_recompiles(run, step)
    if run.out.profiler.after_step(step, metrics):
        run.out.progress.message(f"jtrain: profile trace written to {run.out.profiler.directory}")
    session.pending.append((step, metrics))
    keep = 0 if run.decisions.syncs(step) else cfg.max_steps_in_flight
    return _drained(cfg, run, session, state, keep=keep)


def _evaluate_and_decide(cfg, run: Run, session: _Session, state, step: int):
    """The eval of `step` and what it decides (control.decide: the plateau's learning-rate
    factor, a stop); (state, whether the eval enters the checkpoints' top k)."""
    state = _drained(cfg, run, session, state)  # log lines before the eval line
    run.out.writer.flush()  # ...and in metrics.jsonl before the eval begins
    # The first evaluation compiles the eval step: first_timeout_s too.
    run.watchdog.beat("eval", allowance=None if session.history else
                      cfg.watchdog.first_timeout_s)
    result = run.stopper.interruptible(_evaluate, cfg, run, state, step)  # [] if a signal
    _report_recompiles(run, step)
    if not result:
        return state, False
    state = _decide(cfg, run, session, state, step, result[0])
    return state, run.ckpt.enters_top_k(step, result[0])


def _decide(cfg, run: Run, session: _Session, state, step: int, entry: dict, *,
            act: bool = True):
    """The one decision path of an eval (sync: of `step`; async: of an earlier point,
    applied at `step`): into the history (the best-k registry at the next save), then
    early stopping, the plateau factor and on_eval (control.decide); `act=False` (the
    async evals left at the end): recorded, nothing applied. Returns the state."""
    session.history.append(entry)
    decided = run.decisions.after_eval(entry["step"], entry,
                                       primary=jax.process_index() == 0)
    if not act:
        return state
    if decided.log:
        run.out.writer.write_scalars(step, decided.log)
    if decided.factor is not None:
        state = session.set_factor(state, np.float32(decided.factor))
        run.out.progress.message(
            f"jtrain: step {step}: {cfg.plateau.monitor} has not improved; "
            f"learning-rate factor now {decided.factor:.3g} (plateau.factor)"
            if decided.lr_by == "plateau" else _lr_line(step, decided.factor, decided.lr_by))
    if decided.stop and not session.stopped_by:
        session.stop_reason, session.stopped_by = decided.stop, decided.stopped_by
    session.save_asked = session.save_asked or decided.checkpoint
    return state


def _lr_line(step: int, factor: float, by: str | None) -> str:
    return f"jtrain: step {step}: learning-rate factor now {factor:.3g} (callback {by})"


def _apply_lagged(cfg, run: Run, session: _Session, state, step: int):
    """eval.mode=async at `step`: the eval of step - async_lag * every_steps (waited for
    when the evaluator is behind), written with its own step and decided on."""
    target = run.async_evals.due(step)
    if target is None:
        return state
    state = _drained(cfg, run, session, state)
    entry = _taken(run, target, step)
    return _decide(cfg, run, session, state, step, entry)


def _record_rest(cfg, run: Run, session: _Session) -> None:
    """The end of an async run: the evals of its held points, waited for, written and
    recorded (history, monitors' best) in step order; they decide nothing any more."""
    for target in sorted(run.async_evals.ckpt.held):
        _decide(cfg, run, session, None, target, _taken(run, target, None), act=False)


def _taken(run: Run, target: int, step: int | None) -> dict:
    """The async eval of `target`, its metrics written with that step and its line."""
    with run.goodput.phase("eval"):
        entry = run.async_evals.take(target, lambda: run.watchdog.beat("async eval"),
                                     run.out.progress.message)
    scalars = {k: v for k, v in entry.items() if k != "step"}
    run.out.writer.write_scalars(target, scalars)
    at = f", applied at step {step}" if step is not None else ""
    run.out.progress.message(f"jtrain: eval at step {target} (async{at}): "
                             + evaluator.headline(scalars), emphasis=True)
    return entry


def _save(cfg, run: Run, session: _Session, state, step: int):
    """Checkpoint `step`: every step in flight drained first (a halt found there ends the
    run before anything is saved; a spike rolls the state back), the params checked
    finite. Returns the state saved."""
    state = _drained(cfg, run, session, state)
    run.watchdog.beat("save")
    if not bool(session.all_finite(state.params)):
        error = NonFiniteError(f"the params became non-finite by step {step} (an update "
                               "overflowed); not saved; lower optim.lr or set optim.clip_norm")
        error.step = step
        raise error
    with run.goodput.phase("checkpoints", saved=step):  # a snapshot: saves are async
        run.ckpt.save(step, state, run.train_iter.get_state(), evals=session.history,
                      stopped_by=session.stopped_by, monitors=run.decisions.state(),
                      skip_ledger=list(run.decisions.ledger.entries))
    session.saved, session.save_asked = step, False
    if run.async_evals is not None:
        run.async_evals.saved(step)  # an evaluation point: held until applied
    multihost.heartbeat.note_checkpoint(step)  # for a failed peer's line
    return state


def _drained(cfg, run: Run, session: _Session, state, *, keep: int = 0):
    """Steps in flight drained, oldest first, until `keep` are left; a spike found while
    draining: the rest of the undone steps drained too (no spike checks), then the state
    rolled back (`_rollback`) before anything else happens. Returns the state."""
    while len(session.pending) > keep or (session.pending and session.rollback is not None):
        _drain(session.pending.popleft(), cfg, run, session)
    if session.rollback is not None:
        state = _rollback(cfg, run, state, *session.rollback)
        session.rollback = None
    asked = run.decisions.take()  # what the drained steps' hooks asked for
    if asked.lr_by is not None and state is not None:
        factor = run.decisions.lr_factor()
        state = session.set_factor(state, np.float32(factor))
        run.out.progress.message(_lr_line(session.last_drained, factor, asked.lr_by))
    if asked.stop and not session.stopped_by:
        session.stop_reason, session.stopped_by = asked.stop, asked.stopped_by
    session.save_asked = session.save_asked or asked.checkpoint
    return state


def _report_recompiles(run: Run, step: int) -> None:
    """A compile after the first step, said once each: the function and its shapes."""
    for c in run.startup.recorder.unreported():
        if c["kind"] == "again":
            run.out.progress.message(
                f"jtrain: step {step}: compiled {c['function']} again ({c['sec']:.2f} s) "
                f"for arguments {_changed(c['before'], c['shapes'])}")
        else:  # expected once (the eval step at the first eval, a save's check)
            run.out.progress.message(f"jtrain: step {step}: compiled {c['function']} "
                                     f"({c['sec']:.2f} s)", level=2)


def _changed(before: str, now: str) -> str:
    """The arguments whose shapes changed, else all of them (shortened)."""
    old, new = before.split(", "), now.split(", ")
    diff = [f"#{i}: {a} -> {b}" for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b]
    if len(old) == len(new) and diff:
        return "; ".join(diff)[:300]
    return f"{now[:300]} (before: {before[:150]})"


def _drain(item, cfg, run: Run, session: _Session) -> None:
    """Wait for an old step (bounds dispatch) and read its status and loss (one fetch of
    two scalars: spike checks and the log window's mean loss); on log steps, fetch and
    write its metrics, with `train/loss_window` (the mean over the window's applied
    steps drained in this session)."""
    step, metrics = item
    status, loss = jax.device_get((metrics["train/status"], metrics["train/loss"]))
    status, loss = int(status), float(loss)
    session.hashes.drained(step)
    session.last_drained = step
    if session.rollback is None:  # the steps a rollback undoes are shown to no rule
        asked = run.decisions.after_step(step, status, loss)
        if asked.rollback is not None:
            session.rollback = (step, asked.rollback)
        if asked.log:
            run.out.writer.write_scalars(step, asked.log)
    if not status and np.isfinite(loss):  # the log window's mean: applied updates only
        session.window = (session.window[0] + loss, session.window[1] + 1)
    if status:
        small = jax.device_get({k: metrics[k] for k in
                                ("train/skipped_steps", "train/consecutive_skips")})
        rows_ok = np.asarray(jax.device_get(metrics["train/rows_ok"]))
        run.decisions.nonfinite(step, status, int(small["train/skipped_steps"]),
                                int(small["train/consecutive_skips"]), rows_ok)
    if step % cfg.log.every_steps and step != cfg.total_steps:
        return
    fetched = jax.device_get(metrics)  # log.train_metrics' states ride along: one fetch
    states = fetched.pop(step_lib.TRAIN_METRICS, None)
    values = {k: float(v) for k, v in fetched.items()
              if k not in ("train/status", "train/rows_ok", "train/consecutive_skips")}
    if states is not None:
        values.update(step_lib.train_metric_values(states))
    values.update(run.out.perf.log_values(step, values.pop("train/tokens")))
    total, count = session.window
    values["train/loss_window"] = total / count if count else float("nan")
    session.window = (0.0, 0)
    values.update(run.decisions.after_log(step, values))  # divergence; callback/* scalars
    run.out.writer.write_scalars(step, values)
    if run.out.progress.batches_per_epoch is None:  # a stream: learned after one epoch
        learned = getattr(run.train_iter, "epoch_batches", None)
        if learned:
            run.out.progress.batches_per_epoch = learned
            run.out.progress.message(f"jtrain: data: an epoch of the stream is {learned:,} "
                                     "batches (learned at the end of its first epoch)")
    run.out.progress.update(step, values)
    session.train_history.append({"step": step, **{k: v for k, v in values.items()
                                                   if k.startswith("train/")}})
    if cfg.log.verbosity >= 2:
        run.out.progress.message(run.out.perf.debug_line(), level=2)


def _rollback(cfg, run: Run, state, spike_step: int, z: float):
    """The state of the newest periodic checkpoint before `spike_step` (or the initial
    state of a fresh run without one), carried forward to the current step: the steps since count
    as skipped (so the schedule's position is the checkpoint's), the data goes on with
    the next batch, and step numbers, checkpoints and metrics.jsonl stay monotonic."""
    current = int(jax.device_get(state.step))
    # Periodic checkpoints first: a SIGTERM or best-eval save exists in some runs of the
    # same command and not in others, and the target must not depend on that.
    older = [s for s in run.ckpt.all_steps() if s < spike_step]
    older = [s for s in older if s % cfg.checkpoint.every_steps == 0] or older
    if older:
        to_step = older[-1]
        restored = run.ckpt.restore_state(to_step, run.build.abstract_with_shardings())
    elif run.resumed_from is None:
        to_step, restored = 0, run.build.init()
    else:  # unreachable: the checkpoint this run resumed from is kept and older
        raise NonFiniteError(f"a loss spike at step {spike_step} and no checkpoint before "
                             "it to roll back to")
    del state  # donated buffers of the undone trajectory
    run.decisions.rolled_back(spike_step, z, to_step, current)
    undone = current - int(jax.device_get(restored.step))
    return jax.jit(lambda s, n, f: s.replace(
        step=s.step + n, skipped_steps=s.skipped_steps + n, consecutive_skips=0 * n,
        lr_factor=f), donate_argnums=0, out_shardings=run.build.shardings)(
        restored, np.int32(undone), np.float32(run.decisions.lr_factor()))


def _evaluate(cfg, run: Run, state, step: int) -> dict:
    """The eval of `state` at `step` (a population: of each member, combined), a
    mixture's components as eval/<name>/...; written, said, and returned as the
    history's record."""
    if run.data.eval is None and run.lm_tasks is None:
        return {"step": step}
    t0 = time.perf_counter()
    with run.goodput.phase("eval"):
        result = (evaluator.Evaluation({}, {}, 0) if run.data.eval is None
                  else _score(cfg, run, state, run.data.eval))
        for name, part in run.data.eval_parts.items():  # a mixture's components
            result.scalars.update({f"eval/{name}/{k.removeprefix('eval/')}": v
                                   for k, v in _score(cfg, run, state, part).scalars.items()})
        for which in evaluator.weight_sets(cfg.eval.weights) if run.lm_tasks else ():
            result.scalars.update(run.lm_tasks(state_lib.eval_params(state, which),
                                               evaluator.PREFIXES[which]))
    run.out.perf.add("eval", time.perf_counter() - t0)
    run.out.writer.write_scalars(step, result.scalars)
    run.out.progress.message(evaluator.format_line(step, result), emphasis=True)
    return {"step": step, **result.scalars}


def _score(cfg, run: Run, state, data) -> evaluator.Evaluation:
    """One eval set scored (engine.evaluation: the params, the EMA or both)."""
    b = run.build
    evaluate = functools.partial(
        evaluator.evaluate_weights, b.eval_step, source=data, weights=cfg.eval.weights,
        mesh=b.mesh, local_batch=run.data.eval_batch, max_batches=cfg.eval.num_batches,
        spec=b.eval_spec, tail_step=b.eval_tail)
    if b.population is not None:
        return population_lib.per_member(b.population, state, evaluate)
    return evaluate(state)
