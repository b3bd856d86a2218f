"""Faults on purpose: `debug.faults`, the user's (below), and JTRAIN_FAULT, for
`--verify_resume` and the tests (never set it by hand).

JTRAIN_FAULT=`step:N` SIGKILLs this process right after its N-th step was dispatched,
`eval:N` shortly after its N-th evaluation began, `save:N` while its N-th checkpoint is
being written in the background, `restore:1` while the checkpoint is being restored,
`compile:1` while the first step compiles; `step:N:TERM` (or `:INT`) sends that signal
instead.
`noise:N` adds 1e-3 to the first float parameter right after global step N (a planted
nondeterministic op: what `jtrain replay` must report).
`hang:N[:SECONDS]` makes the N-th step's fault point sleep SECONDS (default 3600) in the
calling thread instead, a stuck step for the hang watchdog (control.watchdog) to catch.
JTRAIN_FAULT_PROCESS=i arms the plan in process i (JTRAIN_PROCESS_ID) only, for
launch/local.sh runs where every process gets the same environment.
JTRAIN_SKIP_DATA_RESTORE (the negative control of --verify_resume): restarts ignore the
saved data position.

`debug.faults` (the config; its syntax and each kind's end in docs/guide/run-control.md)
is the user's plan, by global step and process: `arm_plan` reads it at the start of each
session, less the faults WORKDIR/faults.jsonl says fired already (a line is written
before a fault acts, and uploaded then on an object store, so a kill at step 7 does not
kill the restart that recomputes step 7 again). Its points: `fault_point("step", step)`
after each step (kill, hang, slow, lost_local),
`before_step` / `perturb` around a step (nan: the first float parameter is NaN for that
step only; writer_fail), `tear` in a save's commit (torn_ckpt).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
import time
from typing import Callable

from jtrain.config.rules import Fault, parse_faults
from jtrain.errors import ConfigError
from jtrain.observe import layout, runfiles

FAULT_ENV = "JTRAIN_FAULT"
FAULT_PROCESS_ENV = "JTRAIN_FAULT_PROCESS"
SKIP_DATA_RESTORE_ENV = "JTRAIN_SKIP_DATA_RESTORE"

_armed: tuple[str, int, str | None] | None = None  # (plan kind, N, signal or seconds)
_skip_data_restore = False
_fault_counts: dict[str, int] = {}
_lose_local: Callable[[], None] | None = None  # the local tier's lost_local (checkpoint.tiers)
FILE = "faults.jsonl"  # in the workdir: the faults of debug.faults that fired


class _Plan:
    """This session's debug.faults: those not fired yet in this process."""

    def __init__(self, faults: list[Fault], path: str | None, process: int,
                 publish: Callable[[str], None] | None = None):
        self.faults, self.path, self.process = faults, path, process
        self.publish = publish  # a workdir on an object store: uploads FILE (see fire)
        self.slowing: list[Fault] = []  # slow faults fired in this session
        self.poisoned = None  # (leaf index, the leaf before its NaN) during a nan step

    def due(self, kind: str, step: int, *, from_step: bool = False) -> Fault | None:
        for f in self.faults:
            if f.kind == kind and (f.first <= step if from_step else f.first == step):
                return f
        return None

    def fire(self, fault: Fault, step: int) -> None:
        """Recorded in WORKDIR/faults.jsonl (synced) before it acts: never again."""
        self.faults.remove(fault)
        if self.path is None:
            return
        line = json.dumps({"fault": fault.text, "process": self.process, "step": step,
                           "time": round(time.time(), 3)}) + "\n"
        with layout.open_append(self.path) as f:  # never through a link
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        if self.publish is not None:  # a kill uploads nothing after it: the restart
            self.publish(FILE)        # pulls the bucket, not this staging copy


_plan = _Plan([], None, 0)


def arm() -> None:
    """Read the test-only environment once, at the start of a run (`control.Stopper`
    calls it on entry); production code only ever calls the no-op hooks below."""
    global _armed, _skip_data_restore
    spec = os.environ.get(FAULT_ENV)
    _skip_data_restore = bool(os.environ.get(SKIP_DATA_RESTORE_ENV))
    _fault_counts.clear()
    _armed = None
    only = os.environ.get(FAULT_PROCESS_ENV)
    if only is not None and only != os.environ.get("JTRAIN_PROCESS_ID", "0"):
        spec = None
    if spec:
        parts = spec.split(":")
        _armed = (parts[0], int((parts[1:2] or ["1"])[0]), (parts[2:3] or [None])[0])


def arm_plan(cfg, workdir: str | None, process: int = 0, processes: int = 1,
             publish: Callable[[str], None] | None = None) -> None:
    """debug.faults of this session, in process `process` of `processes`: the faults for
    this process that WORKDIR/faults.jsonl does not list as fired. A hang for good needs
    the watchdog (nothing else ends it): a ConfigError when it is off. `publish(rel)`:
    a workdir on an object store, the upload of that file of the staging copy, called
    when a fault fires (before it acts)."""
    global _plan
    faults = parse_faults(cfg.debug.faults, cfg.total_steps)
    for f in faults:
        if f.kind == "hang" and f.seconds is None and not _watchdog_on(cfg, processes):
            raise ConfigError("debug.faults", f"{f.text!r} stops the process for good and "
                              "the watchdog is off: set watchdog.timeout_s > 0, or give "
                              f"the hang a length ({f.text}:30s)")
    path = os.path.join(workdir, FILE) if workdir and faults else None
    fired = set()
    if path is not None and os.path.exists(path):
        # a torn last line is skipped (the fault did not act); any other bad line, a link
        # or a FIFO is one WorkdirError before the first step
        for record in runfiles.read_ledger(path, _fired_fields, cap=runfiles.JSON):
            fired.add((record["fault"], record["process"]))
    mine = [f for f in faults if (f.text, process) not in fired and (
        f.process in (None, process) if f.kind in ("kill", "hang", "slow")
        else f.kind == "nan" or process == 0)]
    _plan = _Plan(mine, path, process, publish)


def _fired_fields(record: dict) -> str | None:
    return runfiles.check_fields(record, {"fault": str, "process": int})


def _watchdog_on(cfg, processes: int) -> bool:
    from jtrain.control.watchdog import effective_timeout

    return effective_timeout(cfg.watchdog.timeout_s, processes) > 0


def skip_data_restore() -> bool:
    """True in --verify_negative_control restarts: ignore the saved data position."""
    return _skip_data_restore


def fault_point(kind: str, delay: float = 0.0, step: int | None = None) -> None:
    """At the N-th `kind` event of an armed plan (`kind:N[:SIG]`), send this process
    SIGKILL (or SIGTERM / SIGINT for SIG = TERM / INT), after `delay` seconds; a
    `hang:N[:SECONDS]` plan sleeps at the N-th step instead. After global step `step`:
    debug.faults' kill, hang and slow."""
    if step is not None and (_plan.faults or _plan.slowing):
        _step_faults(int(step or 0))
    if _armed is None:
        return
    hang = _armed[0] == "hang" and kind == "step"
    if _armed[0] != kind and not hang:
        return
    _fault_counts[kind] = _fault_counts.get(kind, 0) + 1
    if _fault_counts[kind] != _armed[1]:
        return
    if hang:
        time.sleep(float(_armed[2] or 3600))
        return
    signum = getattr(signal, f"SIG{_armed[2] or 'KILL'}")
    if delay <= 0:
        os.kill(os.getpid(), signum)
    else:
        threading.Timer(delay, os.kill, (os.getpid(), signum)).start()


def perturb(step: int, state):
    """The state after global step `step`; with `noise:N` armed and step == N, its first
    floating-point parameter moved by 1e-3 (see the module docstring); after a `nan`
    step of debug.faults, that parameter as it was before the step."""
    if _plan.poisoned is not None:
        state = _unpoison(state)
    if _armed is None or _armed[0] != "noise" or step != _armed[1]:
        return state
    import jax
    import jax.numpy as jnp

    leaves, treedef, i = _first_float(state)
    leaves[i] = leaves[i] + jnp.asarray(1e-3, leaves[i].dtype)
    return state.replace(params=jax.tree.unflatten(treedef, leaves))


def _first_float(state):
    """(the params' leaves, their treedef, the index of the first floating-point leaf):
    the parameter `noise` moves and `nan` poisons."""
    import jax
    import jax.numpy as jnp

    leaves, treedef = jax.tree.flatten(state.params)
    return leaves, treedef, next(i for i, x in enumerate(leaves)
                                 if jnp.issubdtype(x.dtype, jnp.floating))


def on_lost_local(lose: Callable[[], None] | None) -> None:
    """What lost_local calls (the local tier's deletion; None: no local tier open)."""
    global _lose_local
    _lose_local = lose


def _step_faults(step: int) -> None:
    """debug.faults after `step`: a slow step sleeps, a hang stops here (for good: the
    watchdog ends the process), a kill is SIGKILL, a lost_local deletes the local
    checkpoint tier (`on_lost_local`) and then is SIGKILL, a replaced machine."""
    plan = _plan
    slow = plan.due("slow", step)
    if slow is not None:
        plan.fire(slow, step)
        plan.slowing.append(slow)
    plan.slowing = [f for f in plan.slowing if step <= f.last]
    for fault in plan.slowing:
        time.sleep(fault.seconds or 0.0)
    hang = plan.due("hang", step)
    if hang is not None:
        plan.fire(hang, step)
        if hang.seconds is not None:
            time.sleep(hang.seconds)
        else:
            while True:  # stopped making progress; the watchdog ends the process
                time.sleep(3600)
    kill = plan.due("kill", step) or plan.due("lost_local", step)
    if kill is not None:
        plan.fire(kill, step)
        if kill.kind == "lost_local" and _lose_local is not None:
            _lose_local()
        os.kill(os.getpid(), signal.SIGKILL)


def before_step(step: int, state, writer=None):
    """debug.faults before `step` runs: `writer_fail` makes the metric writer fail at
    its next write (as a backend's OSError would); `nan` makes the first floating-point
    parameter NaN for this step only (`perturb` puts it back after the step), so the
    step's loss and gradients are NaN and the non-finite policy acts on them."""
    plan = _plan
    if not plan.faults:
        return state
    broken = plan.due("writer_fail", step, from_step=True)
    if broken is not None and writer is not None:
        plan.fire(broken, step)
        writer.fail(OSError(errno.EIO, f"injected writer failure (debug.faults "
                                       f"{broken.text})"))
    nan = plan.due("nan", step)
    if nan is None:
        return state
    plan.fire(nan, step)
    import jax
    import jax.numpy as jnp

    leaves, treedef, i = _first_float(state)
    plan.poisoned = (i, leaves[i])
    leaves[i] = leaves[i] * jnp.asarray(jnp.nan, leaves[i].dtype)
    return state.replace(params=jax.tree.unflatten(treedef, leaves))


def _unpoison(state):
    import jax

    i, leaf = _plan.poisoned
    _plan.poisoned = None
    leaves, treedef = jax.tree.flatten(state.params)
    leaves[i] = leaf
    return state.replace(params=jax.tree.unflatten(treedef, leaves))


def tear(step: int, tmp_dir: str) -> None:
    """debug.faults' torn_ckpt, in the commit of the save of `step` (process 0): the
    first save at or after its step is left as a crash mid-write leaves it (its largest
    file cut in half, no manifest, not renamed into place) and the process is killed."""
    plan = _plan
    torn = plan.due("torn_ckpt", step, from_step=True) if plan.faults else None
    if torn is None:
        return
    plan.fire(torn, step)
    files = [os.path.join(d, n) for d, _, names in os.walk(tmp_dir) for n in names]
    if files:
        largest = max(files, key=os.path.getsize)
        os.truncate(largest, os.path.getsize(largest) // 2)
    os.kill(os.getpid(), signal.SIGKILL)
