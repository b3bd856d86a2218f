"""Fault injection for `--verify_resume` and the tests (never set it by hand).

JTRAIN_FAULT=`step:N` SIGKILLs this process right after its N-th step was dispatched,
`eval:N` shortly after its N-th evaluation began, `save:N` while its N-th checkpoint is
being written in the background; `step:N:TERM` (or `:INT`) sends that signal instead.
JTRAIN_SKIP_DATA_RESTORE (the negative control of --verify_resume): restarts ignore the
saved data position.
"""

from __future__ import annotations

import os
import signal
import threading

FAULT_ENV = "JTRAIN_FAULT"
SKIP_DATA_RESTORE_ENV = "JTRAIN_SKIP_DATA_RESTORE"

_fault_counts: dict[str, int] = {}


def fault_point(kind: str, delay: float = 0.0) -> None:
    """At the N-th `kind` event, when JTRAIN_FAULT=`kind:N[:SIG]`, send this process
    SIGKILL (or SIGTERM / SIGINT for SIG = TERM / INT), after `delay` seconds."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    parts = spec.split(":")
    want, n, sig = parts[0], (parts[1:2] or ["1"])[0], (parts[2:3] or ["KILL"])[0]
    if want != kind:
        return
    _fault_counts[kind] = _fault_counts.get(kind, 0) + 1
    if _fault_counts[kind] != int(n):
        return
    signum = getattr(signal, f"SIG{sig}")
    if delay <= 0:
        os.kill(os.getpid(), signum)
    else:
        threading.Timer(delay, os.kill, (os.getpid(), signum)).start()


