"""Process start-up of jtrain's own entry points, before anything heavy is imported.

`boot.start(command)` is the first statement of every entry point (`python -m
jtrain.main|evaluate|export|tune|bench`, the `jtrain` script; `command` is the
subcommand's name, so `python -m jtrain.main` and `jtrain train` start alike) and the
only place process-wide state is set up: importing jtrain changes nothing. In order:

1. jtrain.hostmem's settings: the huge-page re-exec (SIGTERM / SIGINT held across the
   exec), the XLA:CPU scheduler flag, the malloc arena cap;
2. for train and tune, which take signals over later, SIGTERM / SIGINT during start-up
   are recorded in `EARLY_SIGNALS` instead of killing the process: the run stops before
   its first step, exit 0 (other commands keep Python's default);
3. absl's flags marked parsed (grain reads them in its workers);
4. for train, the garbage collector paused through the imports; `resume_gc` then
   freezes the ~180 k imported objects (`gc.freeze`: no later collection walks them)
   and turns it back on (collector CPU of a 10-step run 0.28 -> 0.19 s).

`JTRAIN_BOOT_RECORD=FILE` appends one JSON line per start saying what start-up did; the
tests compare the entry points with it. Imports nothing of jtrain but `hostmem`.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import threading
import time

from jtrain import hostmem

STOPPABLE = ("train", "tune")  # commands whose run takes early signals over
GC_PAUSED = ("train",)  # commands whose imports run without the collector
RECORD_ENV = "JTRAIN_BOOT_RECORD"

# SIGTERM / SIGINT names received during start-up (the first one only); taken over by
# control.signals.Stopper (train) and the tune worker's loop.
EARLY_SIGNALS: list[str] = []
_started: list[float] = []  # perf_counter() when start() began (after the re-exec)
_gc_paused: list[bool] = []  # [True] while start() holds the collector paused


def start(command: str) -> None:
    """Set up this process for the jtrain command `command` (see the module doc)."""
    hostmem.maybe_reexec()  # returns only when no re-exec is needed (or possible)
    hostmem.set_cpu_flags()  # XLA:CPU's smaller-scratch scheduler, unless XLA_FLAGS says
    hostmem.limit_arenas()  # malloc arenas capped before any thread starts
    _started[:] = [time.perf_counter()]
    if command in GC_PAUSED and gc.isenabled():
        gc.disable()  # until the command's imports are done (resume_gc)
        _gc_paused[:] = [True]
    early = command in STOPPABLE and threading.current_thread() is threading.main_thread()
    if early:
        for sig in hostmem.HELD:
            signal.signal(sig, _record_signal)
    hostmem.release_signals()  # signals held across the re-exec arrive now
    mark_absl_parsed()
    if os.environ.get(RECORD_ENV):
        _write_record(command, early)


def resume_gc() -> None:
    """Freezes what was imported and turns the garbage collector back on, if `start()`
    paused it (a no-op otherwise, and from the second call on); see the module doc."""
    if _gc_paused:
        _gc_paused.clear()
        gc.freeze()
        gc.enable()


def _record_signal(signum, frame) -> None:
    if not EARLY_SIGNALS:
        EARLY_SIGNALS.append(signal.Signals(signum).name)


def record_signals_until_taken_over() -> dict:
    """Installs the start-up handler for SIGTERM / SIGINT (main thread only) and returns
    the previous handlers (for `signal.signal` to restore): the tune worker's wait
    between trials, where nothing is running that needs saving."""
    return {sig: signal.signal(sig, _record_signal) for sig in hostmem.HELD}


def early_signal() -> str | None:
    """The signal received during start-up, if any (it stays recorded)."""
    return EARLY_SIGNALS[0] if EARLY_SIGNALS else None


def take_early_signal() -> str | None:
    """The signal received during start-up, if any; the caller handles it now."""
    return EARLY_SIGNALS.pop() if EARLY_SIGNALS else None


def since_start() -> float:
    """Seconds since `start()` (0.0 when this process did not start through it)."""
    return time.perf_counter() - _started[0] if _started else 0.0


def mark_absl_parsed() -> None:
    """grain (and orbax) read absl's global flags; outside `absl.app.run` nobody parsed
    them, and reading one raises UnparsedFlagAccessError. Marked parsed by the entry
    points at start-up, and before jtrain starts grain worker processes in a script."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def _write_record(command: str, early: bool) -> None:
    handler = signal.getsignal(signal.SIGTERM)
    record = {
        "command": command,
        "reexecuted": bool(os.environ.get(hostmem.DONE_ENV)),
        "hugetlb": f"{hostmem.TUNABLE}=1" in os.environ.get("GLIBC_TUNABLES", ""),
        "early_signals": early and handler is _record_signal,
        "jax_imported": "jax" in sys.modules,
        "gc_paused": bool(_gc_paused) and not gc.isenabled(),
    }
    with open(os.environ[RECORD_ENV], "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
