"""Hang watchdog: a step, an eval or a save that takes longer than `watchdog.timeout_s`
ends the process with exit code 5 after dumping the Python stacks of all threads.

Why exit instead of raising: the stuck thread is blocked (in a collective, in I/O, in a
user's data code) and cannot be unwound from outside. Exiting is also what frees the
peers of a multi-process run: a peer stuck in Python keeps its heartbeats going and hangs
the others forever, while a peer that is gone makes them abort after JAX's heartbeat
timeout.

    with Watchdog(timeout_s, first_timeout_s, log_path=...) as watchdog:
        watchdog.beat("step", first_timeout_s)   # the first step compiles
        ...
        watchdog.beat("step")                    # before every step, eval, save
        ...
        watchdog.pause()                         # after the loop: nothing is timed

The loop only assigns one attribute per beat (atomic under the GIL): no lock, no thread
per step. One daemon thread sleeps until the current deadline (at most a quarter of the
timeout at a time) and checks it.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

from jtrain.errors import HangError, render
from jtrain.observe import layout

LOG_FILE = "hang.log"  # in the workdir: the line and the stacks, appended
AUTO_TIMEOUT_S = 1800.0  # watchdog.timeout_s = -1 with several processes
EXIT_CODE = HangError.exit_code


def effective_timeout(cfg_timeout: float, process_count: int) -> float:
    """The timeout `watchdog.timeout_s` means for this run; 0 = off. A negative value
    (-1, the default) is AUTO_TIMEOUT_S with several processes (where a hang blocks the
    peers) and off with one (a person watching a single process can stop it)."""
    if cfg_timeout < 0:
        return AUTO_TIMEOUT_S if process_count > 1 else 0.0
    return float(cfg_timeout)


class Watchdog:
    """Exits the process (code 5) when the phase named by the last `beat` overruns.

    `timeout_s <= 0` turns it off: no thread, and `beat` / `pause` do nothing that
    matters. On entry the start-up phase is timed with `first_timeout_s` (<= 0: untimed).
    `log_path` (appended to) gets the line and the stacks too, headed by the time,
    `process_index` and the pid."""

    def __init__(self, timeout_s: float, first_timeout_s: float, *,
                 log_path: str | None = None, process_index: int = 0):
        self.timeout_s = float(timeout_s)
        self.first_timeout_s = float(first_timeout_s)
        self.log_path = log_path
        self.process_index = process_index
        # (deadline on time.monotonic, phase, allowance) or None = paused; replaced
        # whole by `beat` so the thread never sees a half-updated deadline.
        self._armed: tuple[float, str, float] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    def __enter__(self) -> Watchdog:
        if self.enabled:
            self.beat("start-up", self.first_timeout_s)
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="jtrain-watchdog",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> bool:
        self._armed = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        return False

    def beat(self, phase: str, allowance: float | None = None) -> None:
        """`phase` ("step", "eval", "save", ...) starts now and may take `allowance`
        seconds (None: timeout_s; <= 0: untimed, like `pause`)."""
        limit = self.timeout_s if allowance is None else allowance
        self._armed = (time.monotonic() + limit, phase, limit) if limit > 0 else None

    def pause(self) -> None:
        """Nothing is timed until the next `beat` (e.g. after the loop ends)."""
        self._armed = None

    def _run(self) -> None:
        cap = max(self.timeout_s / 4, 0.05)
        wait = cap
        while not self._stop.wait(wait):
            armed = self._armed
            if armed is None:
                wait = cap
                continue
            left = armed[0] - time.monotonic()
            if left <= 0:
                self._fire(armed[1], armed[2])
                return
            wait = min(left + 0.01, cap)

    def _message(self, phase: str, allowance: float) -> str:
        key = ("watchdog.first_timeout_s"
               if allowance == self.first_timeout_s != self.timeout_s
               else "watchdog.timeout_s")
        return render(HangError(f"{phase} exceeded {allowance:g} s ({key}); "
                                "stacks of all threads follow"))

    def _fire(self, phase: str, allowance: float) -> None:
        line = self._message(phase, allowance)
        try:
            sys.stderr.flush()
        except (OSError, ValueError):  # a closed or broken stderr must not stop the exit
            pass
        # os.write / faulthandler write to the file descriptors directly: the stuck
        # thread may hold sys.stderr's buffer lock.
        os.write(2, (line + "\n").encode())
        faulthandler.dump_traceback(file=2, all_threads=True)
        if self.log_path:
            try:
                with layout.open_append(self.log_path) as f:
                    f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} process "
                            f"{self.process_index} (pid {os.getpid()}): {line}\n")
                    f.flush()
                    faulthandler.dump_traceback(file=f, all_threads=True)
            except OSError as e:
                os.write(2, f"jtrain: could not write the stacks to {self.log_path}: "
                            f"{e}\n".encode())
        from jtrain.multihost import heartbeat

        heartbeat.announce(EXIT_CODE)  # peers name this process and its status at once
        os._exit(EXIT_CODE)
