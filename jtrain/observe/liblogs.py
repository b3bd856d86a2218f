"""Library logs (orbax, absl, grain, jax) and uncaught thread exceptions: into
WORKDIR/train.log instead of the console, unless `--verbosity=2`.

A failed background save once printed 331 lines of orbax logging and asyncio tracebacks
before jtrain's own line. The command-line entry points call `to_train_log(workdir)`
before any library runs: the records of Python's root logger (where absl sends orbax's,
grain's and jax's) and the tracebacks of threads that die are appended, redacted and
time-stamped, to WORKDIR/train.log, which the console's log shares. The person at the
terminal sees jtrain's lines and the one error line; train.log has the detail.
`append_traceback(workdir, line, exc)` records the traceback behind an error line.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import traceback

from jtrain.redact import redact_text
from jtrain.observe import layout
from jtrain.errors import WorkdirError

LOG_FILE = "train.log"  # the same file as observe.console.LOG_FILE
_PENDING_MAX = 2000  # records kept while the workdir does not exist yet


def _stamp() -> str:
    return datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")


def _append(workdir: str, text: str) -> bool:
    """Appends `text` to WORKDIR/train.log if the workdir exists; False if it could not."""
    if not workdir or not os.path.isdir(workdir):
        return False
    try:
        with layout.open_append(os.path.join(workdir, LOG_FILE)) as f:
            f.write(redact_text(text))
        return True
    except (OSError, WorkdirError):  # a full or read-only disk: the error line says so already
        return False


class _TrainLogHandler(logging.Handler):
    """Appends each record to WORKDIR/train.log; records from before the workdir exists
    wait (at most _PENDING_MAX) and are written with the first record after it does."""

    def __init__(self, workdir: str):
        super().__init__(level=logging.DEBUG)
        self.workdir = workdir
        self._pending: list[str] = []
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record):
        try:
            text = f"{_stamp()} [{record.name}] {self.format(record)}\n"
        except Exception:  # noqa: BLE001 - a bad log call in a library must not end the run
            return
        with self.lock:
            self._pending.append(text)
            if _append(self.workdir, "".join(self._pending)):
                self._pending.clear()
            else:
                del self._pending[:-_PENDING_MAX]


def to_train_log(workdir: str, verbosity: int):
    """Below verbosity 2: the root logger writes to WORKDIR/train.log instead of stderr,
    and a thread's uncaught exception is logged there too. Returns the function that
    undoes it (in-process callers: the tests, embedding)."""
    if verbosity >= 2:
        return lambda: None
    import sys

    from absl import logging as absl_logging

    root = logging.getLogger()
    consoles = [h for h in root.handlers if h is absl_logging.get_absl_handler() or
                getattr(h, "stream", None) in (sys.stderr, sys.stdout)]
    for handler in consoles:
        root.removeHandler(handler)
    mine = _TrainLogHandler(os.path.abspath(workdir))
    root.addHandler(mine)
    old_hook = threading.excepthook

    def hook(args):
        if args.exc_type is SystemExit:
            return
        logging.getLogger("jtrain.threads").error(
            "uncaught exception in thread %s", getattr(args.thread, "name", "?"),
            exc_info=(args.exc_type, args.exc_value, args.exc_traceback))

    def excepthook(exc_type, exc, tb):  # also what C code's PyErr_Print calls (asyncio
        # callbacks of tensorstore after orbax closed the loop print through it)
        logging.getLogger("jtrain.threads").error("uncaught exception",
                                                  exc_info=(exc_type, exc, tb))

    def unraisable(args):
        logging.getLogger("jtrain.threads").error(
            "exception ignored in %r", args.object,
            exc_info=(args.exc_type, args.exc_value, args.exc_traceback))

    old_sys_hooks = sys.excepthook, sys.unraisablehook
    threading.excepthook = hook
    sys.excepthook, sys.unraisablehook = excepthook, unraisable

    def undo():
        root.removeHandler(mine)
        for handler in consoles:
            root.addHandler(handler)
        threading.excepthook = old_hook
        sys.excepthook, sys.unraisablehook = old_sys_hooks

    return undo


def append_traceback(workdir: str | None, line: str, exc: BaseException) -> bool:
    """The traceback behind an error, then its line (the log's last line, as on the
    console), appended to WORKDIR/train.log if the workdir exists (a bad config never
    creates one). False if nothing was written."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return _append(workdir or "", f"{text}{_stamp()} {line}\n")
