"""Process start-up of jtrain's own entry points, before anything heavy is imported.

    boot.start(command)

is the first statement of every entry point (`python -m jtrain.main|evaluate|export|
tune|bench` and the `jtrain` console script), and the only place process-wide state is
set up; importing jtrain (the package or any module) changes nothing about the process.
`command` is the subcommand's name ("train", "evaluate", "export", "tune", "bench"), so
`python -m jtrain.main` and `jtrain train` start the same way. In order:

1. the huge-page re-exec (jtrain.hostmem: the process starts again once with
   `glibc.malloc.hugetlb=1`; `JTRAIN_HUGETLB=0` turns it off), with SIGTERM / SIGINT
   held across the exec; then XLA:CPU options added to `XLA_FLAGS` unless it names
   them (`hostmem.CPU_FLAGS`: the scheduler that keeps the step's scratch smaller);
   glibc's malloc arenas capped (`hostmem.limit_arenas`: `JTRAIN_MALLOC_ARENAS`, default
   2; each thread's arena otherwise keeps its own high-water mark of XLA's buffers);
2. for the commands that take them over (train, tune: `control.signals.Stopper`, the
   tune worker's loop), SIGTERM / SIGINT during the imports and start-up are recorded in
   `EARLY_SIGNALS` instead of killing the process with status 143: the run then stops
   before its first step, nothing new to save, exit 0. The other commands keep Python's
   default handling (a SIGTERM ends them);
3. absl's global flags marked parsed (`mark_absl_parsed`): grain reads them in its
   worker processes, and no `absl.app.run` owns jtrain's processes;
4. for the train command, Python's cyclic garbage collector paused while the command
   imports its modules (JAX, Flax, optax, orbax, grain: ~180 k objects that live as long
   as the process). `resume_gc` (the train command calls it once its imports are done)
   freezes them (`gc.freeze`: left out of every later collection, as a server does with
   what it loaded before forking) and turns the collector back on. Measured on a 10-step
   run of a small model: the collector's CPU time 0.28 -> 0.19 s, as no collection walks
   the imported objects again. Objects are still freed by their reference counts; only
   the few reference cycles made while importing (~400 objects) stay.

`JTRAIN_BOOT_RECORD=FILE` appends one JSON line per start to FILE saying what start-up
did (the command, whether it re-executed with huge pages, whether the early handlers
are installed, whether JAX was already imported, whether the collector is paused): the
tests compare the entry points with it.

This module imports nothing of jtrain but `hostmem`, and nothing heavy.
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
