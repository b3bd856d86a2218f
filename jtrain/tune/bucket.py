"""A search whose workdir is on an object store (`--workdir=s3://bucket/study`).

Each trial is a run of its own at `s3://bucket/study/trials/<n>` (or
`populations/<n>`), mirrored to the bucket by its training run as any run is
(jtrain.checkpoint.store). The study's own files (study.db, trials.jsonl,
best_config.py, tune.png) live in a local staging copy: pulled from the bucket at the
start, uploaded after every change of the study (a trial asked, a trial told, the
results written), so that a killed worker's rerun finds the study as it was left.

The default storage, SQLite in the workdir, then travels with the study: one worker at
a time. A lease object, `worker.json` (host, pid, time), names that worker: written at
the start, refreshed while it runs, removed at its end. A worker that finds the lease of
a live one (refreshed within `tune.stale_after_s`, and on the same host its process
still there) stops with a ConfigError naming tune.storage; so does a worker whose lease
another took over (checked before each upload). The trials a gone worker left running
are continued at once (the lease says nobody runs them). Several workers share one study
through `tune.storage` on a shared database: the bucket then holds the trials and the
result files, and the database coordinates the workers as it does for a local workdir.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid

from jtrain.checkpoint import store
from jtrain.errors import ConfigError, JtrainError, WorkdirError
from jtrain.observe import runfiles

LEASE = "worker.json"
TRIAL_DIRS = ("trials", "populations")  # each trial's run mirrors itself



def parse_lease(data: bytes, name: str) -> dict:
    """A lease object's record; anything else (a torn write, a list, a field of another
    type) is a WorkdirError (jtrain.observe.runfiles' rules)."""
    return runfiles.parse_object(data, name, {"host": str, "pid": int, "time": float,
                                              "token": str})

class StudyFiles:
    """The study's files of a search at `uri`: the staging copy (`local`), the lease."""

    def __init__(self, uri: str, tune_cfg, say=None):
        self.uri = uri.rstrip("/")
        self.leased = not tune_cfg.storage  # SQLite in the bucket: one worker
        self.stale_after_s = float(tune_cfg.stale_after_s)
        self.mirror = store.Mirror(self.uri, owner=False, say=say, skip=TRIAL_DIRS)
        self.local = self.mirror.local
        self._lease = f"{self.mirror.root}/{LEASE}"
        self._me = {"host": socket.gethostname(), "pid": os.getpid(),
                    "token": uuid.uuid4().hex}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the lease ----------------------------------------------------------------------
    def _read_lease(self) -> dict | None:
        try:
            data = self.mirror.fs.cat_file(self._lease)
        except FileNotFoundError:
            return None
        except Exception as e:
            raise store.failure(self.uri, e, f"reading {LEASE}") from None
        try:
            return parse_lease(data, self._lease)
        except WorkdirError:  # a torn or foreign object: nobody's lease
            return None

    def _write_lease(self) -> None:
        body = json.dumps({**self._me, "time": time.time()}).encode()
        try:
            self.mirror.fs.pipe_file(self._lease, body)
        except Exception as e:
            raise store.failure(self.uri, e, f"writing {LEASE}") from None

    def _live(self, lease: dict) -> bool:
        """Whether the worker of `lease` may still be running the study."""
        try:
            age = time.time() - float(lease["time"])
            host, pid = lease["host"], int(lease["pid"])
        except (KeyError, TypeError, ValueError):
            return False
        if age > self.stale_after_s:
            return False
        if host == socket.gethostname():
            if pid == os.getpid():
                return False  # our pid in a former life
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                pass  # alive, another user's
        return True

    def _refused(self, lease: dict | None, taken: bool) -> ConfigError:
        who = "another worker" if lease is None else \
            f"worker {lease.get('host', '?')}:{lease.get('pid', '?')}"
        how = "took over" if taken else "runs"
        return ConfigError("tune.storage", f"unset: the study's SQLite database is kept in "
                           f"{self.uri}, one worker at a time, and {who} {how} it; "
                           "for several workers set tune.storage to a database they "
                           "share (e.g. postgresql://...)")

    def _refresh(self) -> None:
        every = min(30.0, self.stale_after_s / 4)
        while not self._stop.wait(every):
            with contextlib.suppress(Exception):  # the next refresh retries
                self._write_lease()

    # -- the staging copy ---------------------------------------------------------------
    def open(self) -> None:
        """Takes the lease (SQLite in the bucket), then pulls the study's files."""
        if self.leased:
            held = self._read_lease()
            if held is not None and held.get("token") != self._me["token"] \
                    and self._live(held):
                raise self._refused(held, taken=False)
            self._write_lease()
            self._thread = threading.Thread(target=self._refresh, daemon=True,
                                            name="tune-lease")
            self._thread.start()
        self.mirror.pull()

    def push(self) -> None:
        """Uploads the study's changed files (the lease still ours)."""
        if self.leased:
            held = self._read_lease()
            if held is None or held.get("token") != self._me["token"]:
                raise self._refused(held, taken=True)
        self.mirror.push()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            with contextlib.suppress(Exception):
                held = self._read_lease()
                if held is not None and held.get("token") == self._me["token"]:
                    self.mirror.fs.rm_file(self._lease)
        self.mirror.close()


@contextlib.contextmanager
def staged(uri: str, tune_cfg, say=None):
    """StudyFiles of the search at `uri`, open; its files uploaded at the end (on an
    error too); an error naming the staging copy names the URI instead."""
    files = StudyFiles(uri, tune_cfg, say)
    try:
        files.open()
        try:
            yield files
        except BaseException as e:
            with contextlib.suppress(Exception):
                files.push()
            if not isinstance(e, JtrainError) or files.local not in str(e):
                raise
            raise type(e)(str(e).replace(files.local, files.uri)) from None
        files.push()
    finally:
        files.close()
