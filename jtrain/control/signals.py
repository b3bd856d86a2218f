"""Preemption signals: `Stopper` turns SIGTERM and SIGINT into "stop after the current
step": the loop saves a checkpoint of the state it has and `train()` returns normally, so
the CLI exits 0 (for both signals; the summary records which). A second SIGINT aborts at
once (KeyboardInterrupt, no final save). After the first signal the run has
`checkpoint.grace_seconds` to finish; past it the process exits 5 with one line, and the
newest finished checkpoint is what a restart resumes from. With several processes
(jax.distributed) SIGTERM belongs to JAX's preemption notifier, and every process stops
at the step `multihost_utils.reached_preemption_sync_point` names; a SIGINT on any
process is shared every `SYNC_EVERY` steps, so all processes stop at the same step.

How the process ends: `freeze_heap_at_exit`.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from jtrain.control import faults
from jtrain.control.faults import fault_point

SYNC_EVERY = 10  # steps between multi-process agreements on host-side decisions
_FREEZE_REGISTERED = False


def freeze_heap_at_exit() -> None:
    """At the interpreter's exit, before its teardown, move every object left to the
    collector's permanent generation (gc.freeze), once per process. The teardown still
    joins threads, runs the exit hooks and frees what reference counting frees; it no
    longer walks the heap JAX, Flax, orbax and grain built, which took 0.3 CPU s of
    every command and script that trained or opened a run (objects only a reference cycle
    still holds are not finalized at exit, which Python does not promise anyway)."""
    global _FREEZE_REGISTERED
    if not _FREEZE_REGISTERED:
        import atexit
        import gc

        atexit.register(gc.freeze)
        _FREEZE_REGISTERED = True


class StopRequested(Exception):
    """Raised inside `Stopper.interruptible()` when a stop signal arrives."""


class Stopper:
    """SIGTERM / SIGINT -> a stop request the loop polls once per step.

    Use as a context manager around setup and the loop: handlers are installed only in
    the main thread and restored on exit."""

    def __init__(self, grace_seconds: float = 30.0):
        self.grace_seconds = grace_seconds
        self.signal_name: str | None = None  # the first stop signal received
        self._interruptible = False
        self._previous: dict[int, Any] = {}
        self._watchdog: threading.Timer | None = None
        self._multi = False

    def __enter__(self):
        faults.arm()  # the test-only fault plan, read once per run
        import jax

        self._multi = jax.process_count() > 1
        if threading.current_thread() is threading.main_thread():
            # Under jax.distributed, SIGTERM is JAX's (preemption notifier): leave it.
            sigs = (signal.SIGINT,) if self._multi else (signal.SIGTERM, signal.SIGINT)
            for sig in sigs:
                self._previous[sig] = signal.signal(sig, self._handle)
        from jtrain import boot

        early = boot.take_early_signal()  # arrived during the CLI's start-up (jtrain.boot)
        if early:
            self._announce(early, during="start-up")
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._watchdog is not None:
            self._watchdog.cancel()
        return False

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.signal_name is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # second Ctrl-C: abort without a final save
            return
        self._announce(name)
        if self._interruptible:
            raise StopRequested(name)

    def _announce(self, name: str, during: str = "") -> None:
        self._request(name)
        what = ("stopping before the first step, nothing new to save" if during else
                "saving a checkpoint of the current step and stopping")
        # os.write: the handler may interrupt a print to sys.stderr (not reentrant).
        os.write(2, (f"\njtrain: {name} received{' during ' + during if during else ''}: "
                     f"{what} (within {self.grace_seconds:g} s"
                     + ("; Ctrl-C again aborts without saving" if name == "SIGINT" else "")
                     + ")\n").encode())

    def _request(self, name: str) -> None:
        if self.signal_name is not None:
            return
        self.signal_name = name
        if self.grace_seconds > 0:
            self._watchdog = threading.Timer(self.grace_seconds, self._grace_expired)
            self._watchdog.daemon = True
            self._watchdog.start()

    def _grace_expired(self) -> None:
        from jtrain.errors import HangError, render

        line = render(HangError(f"no clean stop within the {self.grace_seconds:g} s grace "
                                "period (checkpoint.grace_seconds); exiting; a restart "
                                "resumes from the newest finished checkpoint"))
        os.write(2, (line + "\n").encode())
        os._exit(HangError.exit_code)

    def interruptible(self, fn, *args, **kwargs) -> list:
        """[fn(*args, **kwargs)], or [] when a stop signal arrived before or during the
        call (used for evaluation: a preempted run does not wait for it)."""
        fault_point("eval", delay=0.05)
        if self.signal_name is not None:
            return []
        self._interruptible = True
        try:
            return [fn(*args, **kwargs)]
        except StopRequested:
            return []
        except Exception as e:  # noqa: BLE001 - see below
            # StopRequested raised inside a jitted call can reach us as another error:
            # JAX's traceback filtering fails on the interrupted frame (a TypeError whose
            # context is the StopRequested). Still the stop, not a bug.
            if self.signal_name is not None and isinstance(e.__context__, StopRequested):
                return []
            raise
        finally:
            self._interruptible = False

    def should_stop(self, step: int) -> bool:
        """True when the run must stop after `step`; the same on every process."""
        fault_point("step", step=step)  # test-only plans and debug.faults
        if not self._multi:
            return self.signal_name is not None
        from jax.experimental import multihost_utils

        try:
            if multihost_utils.reached_preemption_sync_point(step):
                self._request("SIGTERM")
                return True
        except RuntimeError:  # preemption service disabled
            pass
        if step % SYNC_EVERY:
            return False
        import numpy as np

        flags = multihost_utils.process_allgather(
            np.asarray([self.signal_name is not None], np.int32))
        if np.any(flags):
            self._request(self.signal_name or "SIGINT")
            return True
        return False


