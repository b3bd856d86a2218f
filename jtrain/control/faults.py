"""Fault injection for `--verify_resume` and the tests (never set it by hand).

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
"""

from __future__ import annotations

import os
import signal
import threading
import time

FAULT_ENV = "JTRAIN_FAULT"
FAULT_PROCESS_ENV = "JTRAIN_FAULT_PROCESS"
SKIP_DATA_RESTORE_ENV = "JTRAIN_SKIP_DATA_RESTORE"

_armed: tuple[str, int, str | None] | None = None  # (plan kind, N, signal or seconds)
_skip_data_restore = False
_fault_counts: dict[str, int] = {}


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


def skip_data_restore() -> bool:
    """True in --verify_negative_control restarts: ignore the saved data position."""
    return _skip_data_restore


def fault_point(kind: str, delay: float = 0.0) -> None:
    """At the N-th `kind` event of an armed plan (`kind:N[:SIG]`), send this process
    SIGKILL (or SIGTERM / SIGINT for SIG = TERM / INT), after `delay` seconds; a
    `hang:N[:SECONDS]` plan sleeps at the N-th step instead."""
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
    floating-point parameter moved by 1e-3 (see the module docstring)."""
    if _armed is None or _armed[0] != "noise" or step != _armed[1]:
        return state
    import jax
    import jax.numpy as jnp

    leaves, treedef = jax.tree.flatten(state.params)
    i = next(i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.floating))
    leaves[i] = leaves[i] + jnp.asarray(1e-3, leaves[i].dtype)
    return state.replace(params=jax.tree.unflatten(treedef, leaves))
