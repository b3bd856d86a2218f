"""Peer liveness during a multi-process run, in one line.

Every process writes a counter under `jtrain/alive/<id>` in JAX's coordination-service
key-value store every `interval` seconds and reads everyone else's; a peer whose counter
has not moved for `distributed.heartbeat_timeout_s` (killed, SIGSTOPped, its machine
gone) or that recorded a failing exit status makes this process print

    jtrain: peer error: peer process 1 stopped responding at step 57; last checkpoint 50

and exit 5, from a thread of its own: the main thread may be blocked in a collective with
that peer and cannot be unwound. The store is not a device collective, so a dead peer
cannot block the check itself; a coordinator (process 0) that stops answering is the same
failure, named as process 0. JAX's own heartbeat timeout is set longer (see start.py), so
this line comes first instead of JAX's C++ abort.

A process that finishes writes `jtrain/exit/<id>` = its status, so peers that end a
little later do not mistake it for a dead one; a non-zero status is reported as such.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time

from jtrain.errors import PeerError, render

ALIVE = "jtrain/alive/"
EXIT = "jtrain/exit/"

# The loop's position, for the line: plain assignments (atomic under the GIL).
_progress = {"step": 0, "checkpoint": None}
_monitor: PeerMonitor | None = None
_fired = threading.Lock()  # one line per process, whichever thread finds the failure


def note_step(step: int) -> None:
    _progress["step"] = step


def note_checkpoint(step: int | None) -> None:
    _progress["checkpoint"] = step


def _where() -> str:
    ckpt = _progress["checkpoint"]
    return (f"at step {_progress['step']}; last checkpoint "
            f"{'none' if ckpt is None else ckpt}")


def fail(what: str) -> None:
    """The one line on stderr, exit 5 (no Python unwinding: other threads may be stuck)."""
    if not _fired.acquire(blocking=False):
        time.sleep(3600)  # the other thread is printing and exiting
    line = render(PeerError(f"{what} {_where()}; a restart resumes from the newest "
                            "checkpoint"))
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os.write(2, (line + "\n").encode())
    os._exit(PeerError.exit_code)


def peer_failed() -> None:
    """Called when a collective raised, so a peer is likely gone: the one whose
    heartbeat stopped first is named (exit 5) as soon as it has missed two beats,
    without waiting out the heartbeat timeout; returns when none has within a few
    beats (then the caller reports the collective's own error)."""
    mon = _monitor
    if mon is None:
        return
    deadline = time.monotonic() + 4 * mon.interval + 1.0
    while time.monotonic() < deadline:
        if mon._ok < time.monotonic() - 2 * mon.interval and mon.me != 0:
            fail("peer process 0 (the coordinator) stopped responding")
        stale = mon.stale(2 * mon.interval)
        if stale:
            fail(f"peer process {stale[0]} stopped responding")
        time.sleep(0.1)


def announce(status: int, wait_s: float = 2.0, linger_s: float = 5.0) -> None:
    """`finished(status, linger_s)` for a process about to `os._exit` (the hang watchdog):
    the store is asked from a thread, for at most `wait_s` + `linger_s`, since it may not
    answer."""
    if _monitor is None:
        return
    t = threading.Thread(target=finished, args=(status, linger_s), daemon=True)
    t.start()
    t.join(wait_s + linger_s)


def finished(status: int, linger_s: float = 0.0) -> None:
    """This process is ending with `status`: tell the peers, stop watching them.
    `linger_s` > 0 on process 0: wait (at most that long) until every peer has recorded
    its own exit. Process 0 hosts JAX's coordination service; when it leaves first, a peer
    that is itself about to print its line and exit gets a C++ fatal from JAX's client
    (lines after its own, sometimes an abort) instead of a clean exit."""
    global _monitor
    mon, _monitor = _monitor, None
    if mon is None:
        return
    mon.stop(status)
    deadline = time.monotonic() + linger_s
    while mon.me == 0 and time.monotonic() < deadline:
        try:
            ended = {_id(k) for k, _ in mon.client.key_value_dir_get(EXIT)}
        except Exception:  # noqa: BLE001 - the store is gone: nothing to wait for
            return
        if len(ended - {None, 0}) >= mon.n - 1:
            return
        time.sleep(0.05)


class PeerMonitor:
    def __init__(self, client, process_id: int, num_processes: int, timeout_s: float):
        self.client, self.me, self.n = client, process_id, num_processes
        self.timeout_s = float(timeout_s)
        self.interval = max(0.2, min(5.0, self.timeout_s / 5))
        now = time.monotonic()
        self._seen: dict[int, tuple[str, float]] = {p: ("", now) for p in range(self.n)
                                                    if p != self.me}
        self._ok = now  # the last time the store answered
        self._done: set[int] = set()
        self._stop = threading.Event()
        self._count = 0

    def start(self) -> PeerMonitor:
        global _monitor
        _monitor = self
        for target, name in ((self._beat, "jtrain-heartbeat"), (self._check, "jtrain-peers")):
            threading.Thread(target=target, name=name, daemon=True).start()
        return self

    def stop(self, status: int) -> None:
        self._stop.set()
        try:
            self.client.key_value_set(f"{EXIT}{self.me}", str(status), allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the coordinator may be gone already
            pass

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self._count += 1
                self.client.key_value_set(f"{ALIVE}{self.me}", str(self._count),
                                          allow_overwrite=True)
                alive = dict(self.client.key_value_dir_get(ALIVE))
                exits = dict(self.client.key_value_dir_get(EXIT))
            except Exception:  # noqa: BLE001 - the coordinator is unreachable: _check times it
                self._stop.wait(self.interval)
                continue
            now = time.monotonic()
            self._ok = now
            for key, value in exits.items():
                pid = _id(key)
                if pid is None or pid == self.me or pid in self._done:
                    continue
                status = exit_status(key, value)
                if status is None:
                    continue
                if status != 0 and not self._stop.is_set():
                    fail(f"peer process {pid} ended with exit status {status}")
                self._done.add(pid)
            for key, value in alive.items():
                pid = _id(key)
                if pid in self._seen and self._seen[pid][0] != value:
                    self._seen[pid] = (value, now)
            self._stop.wait(self.interval)

    def stale(self, age_s: float) -> list[int]:
        """Peers (not finished) silent for more than `age_s`, the longest silent first."""
        now = time.monotonic()
        silent = [(changed, pid) for pid, (_, changed) in self._seen.items()
                  if pid not in self._done and now - changed > age_s]
        return [pid for _, pid in sorted(silent)]

    def _check(self) -> None:
        while not self._stop.wait(self.interval / 2):
            if time.monotonic() - self._ok > self.timeout_s and self.me != 0:
                fail("peer process 0 (the coordinator) stopped responding")
            stale = self.stale(self.timeout_s)
            if stale:
                fail(f"peer process {stale[0]} stopped responding")


_IGNORED: set[str] = set()


def exit_status(key: str, value) -> int | None:
    """A peer's exit status as the key-value store holds it, an integer; anything else
    (not written by jtrain) is ignored with one warning per key, never a stop."""
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    text = text.strip()
    if re.fullmatch(r"-?[0-9]{1,4}", text):
        return int(text)
    if key not in _IGNORED:
        _IGNORED.add(key)
        sys.stderr.write(f"jtrain: warning: ignoring {key} = {text[:40]!r} in JAX's "
                         "key-value store: not an exit status\n")
    return None


def _id(key: str) -> int | None:
    tail = key.rstrip("/").rsplit("/", 1)[-1]
    return int(tail) if tail.isdigit() else None
