"""Background prefetch of the next batches onto the devices.

A thread takes host batches from the train iterator and puts them on the devices with the
one transfer function it is given (`jtrain.mesh.host_to_device`), `depth` batches ahead,
so that the step does not wait on the host when the loader keeps up. The data layer
itself never touches devices: the transfer function comes from the caller.

`get_state()` is the position of the next batch the *step* will consume: the thread
records the host iterator's state right after reading each batch and hands it over with
the batch, so batches read ahead but not yet consumed are read again after a resume.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from typing import Callable

_POLL_S = 0.1
_JOIN_S = 30.0  # how long close() waits for a host read in progress


class DevicePrefetch:
    def __init__(self, host_iter, put: Callable, depth: int):
        self.host, self.put, self.depth = host_iter, put, depth
        self._state = copy.deepcopy(host_iter.get_state())
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def epoch_batches(self) -> int | None:
        """A stream's batches per epoch once learned (data.streams), else None."""
        return getattr(self.host, "epoch_batches", None)

    def __iter__(self):
        return self

    def __next__(self):
        if self.depth == 0:  # synchronous: read, record the position, transfer
            batch = next(self.host)
            self._state = copy.deepcopy(self.host.get_state())
            return self.put(batch)
        if self._thread is None:
            self._start()
        kind, value, state = self._queue.get()
        if kind == "error":
            self._thread.join()
            self._thread = None  # the next call starts over and raises again if it must
            raise value
        self._state = state
        return value

    def _start(self):
        self._stop.clear()
        self._queue = queue.Queue(maxsize=self.depth)
        self._thread = threading.Thread(target=self._run, name="jtrain-device-prefetch",
                                        daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                batch = next(self.host)
                state = copy.deepcopy(self.host.get_state())
                item = ("batch", self.put(batch), state)
            except BaseException as e:  # handed to the consumer, raised there
                item = ("error", e, None)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=_POLL_S)
                    break
                except queue.Full:
                    continue
            if item[0] == "error":
                return

    def _halt(self):
        if self._thread is None:
            return
        self._stop.set()
        deadline = time.monotonic() + _JOIN_S
        while self._thread.is_alive() and time.monotonic() < deadline:
            try:  # unblock a thread waiting to put
                self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                pass
        self._thread.join(timeout=_POLL_S)  # a host read stuck past the deadline: let it be
        self._thread, self._queue = None, None

    def get_state(self) -> dict:
        return self._state

    def set_state(self, state: dict) -> None:
        self._halt()
        self.host.set_state(state)
        self._state = copy.deepcopy(state)

    def close(self) -> None:
        self._halt()
        if hasattr(self.host, "close"):
            self.host.close()
