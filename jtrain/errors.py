"""Every error a user can cause, each with its exit code, and the one function that
renders any exception as the one line a person sees.

    ConfigError    2  a bad config key or value: `<dotted.key>: <why>`
    DataError      2  bad input data: names the dataset and the item or field
    UsageError     2  a bad command line (an unknown flag, a missing argument)
    EvaluateError  2  an evaluation that cannot be done as asked (no such step, no split)
    RestoreError   3  a checkpoint that cannot be used as asked (damaged with
                      strict_restore, another model, a changed config)
    ExportError    3  an export that cannot be written or read
    CheckpointError 3 a checkpoint write that failed (possibly in the background)
    NonFiniteError 4  training halted on non-finite values (nonfinite.policy)
    HangError      5  a step, eval or save past watchdog.timeout_s (control.watchdog)
    PeerError      5  a collective with another process failed (a peer died or hung)
    WorkdirError   2  the workdir (or an output directory) cannot be written: a file, a
                      read-only file system, no permission
    DiskFullError  6  no space left on the device holding the workdir (ENOSPC), at any
                      moment of the run: free space, rerun the same command to continue
    any other      1  a bug in jtrain or in user code: `jtrain: internal error: ...`, the
                      traceback in WORKDIR/train.log

Entry points print `render(e)` on stderr and exit with `exit_code(e)`; no traceback for
any of these. `classify(e)` turns what libraries raise (OSError, orbax's wrapped I/O
errors) into the error above that says what to change. Every rendered line passes
through the redactor (jtrain.redact).
"""

from __future__ import annotations

import errno


class JtrainError(Exception):
    """Base of jtrain's user-facing errors: `kind` names it in the one line."""

    kind = "jtrain"
    exit_code = 1


class ConfigError(JtrainError, ValueError):
    """A bad config value; str(e) is `<dotted.key>: <why>`."""

    kind, exit_code = "config", 2

    def __init__(self, key: str, why: str = ""):
        super().__init__(f"{key}: {why}" if why else key)
        self.key = key


class DataError(JtrainError, ValueError):
    """Bad input data; str(e) is one line naming the dataset and the item or field."""

    kind, exit_code = "data", 2


class UsageError(JtrainError, ValueError):
    """A bad command line: an unknown flag, a missing or malformed argument."""

    kind, exit_code = "usage", 2


class EvaluateError(JtrainError, ValueError):
    """`python -m jtrain.evaluate` cannot do what was asked (no such step, no eval split)."""

    kind, exit_code = "evaluate", 2


class RestoreError(JtrainError):
    """A checkpoint that cannot be used as asked: exit code 3, one line."""

    kind, exit_code = "restore", 3


class ExportError(JtrainError):
    """An export that cannot be written or read."""

    kind, exit_code = "export", 3


class CheckpointError(JtrainError):
    """A save that failed (possibly in the background): exit code 3, one line."""

    kind, exit_code = "checkpoint", 3


class NonFiniteError(JtrainError):
    """Training halted on a non-finite loss or gradient (`nonfinite.policy=halt`, or
    `nonfinite.max_consecutive` skips in a row): exit code 4."""

    kind, exit_code = "non-finite", 4


class HangError(JtrainError):
    """A step, eval or save took longer than `watchdog.timeout_s`: exit code 5. The
    watchdog renders it and exits the process itself (a stuck thread cannot raise)."""

    kind, exit_code = "hang", 5


def first_line(e: BaseException) -> str:
    """The first non-empty line of an exception's message, or its type's name."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class PeerError(JtrainError):
    """A collective with the other processes failed: a peer died or hung up."""

    kind, exit_code = "peer", 5


class WorkdirError(JtrainError):
    """The workdir (or --out) cannot hold a run: a file, read-only, no permission."""

    kind, exit_code = "workdir", 2


class DiskFullError(JtrainError):
    """No space left on the device (ENOSPC) while writing the run's files: exit code 6."""

    kind, exit_code = "disk", 6


# What a write that failed for lack of space says, wherever it was raised: Python's
# OSError, or tensorstore's status text inside orbax's errors.
_NO_SPACE = ("No space left on device", "os_error_code='28'", "[Errno 28]")
_NOT_WRITABLE = {errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                 errno.EPERM: "operation not permitted", errno.ENOTDIR: "not a directory",
                 errno.EEXIST: "exists and is not a directory"}


def classify(e: BaseException, where: str = "", flag: str = "--workdir") -> BaseException:
    """The JtrainError a person should see for `e` (`e` itself when nothing fits).

    ENOSPC anywhere (an OSError, or orbax's error around tensorstore's) is a
    DiskFullError; a write refused by the file system is a WorkdirError naming the path."""
    chain = [e, e.__cause__, e.__context__]
    text = " ".join(str(c) for c in chain if c is not None)
    no_space = any(isinstance(c, OSError) and c.errno == errno.ENOSPC for c in chain)
    if no_space or any(m in text for m in _NO_SPACE):
        place = getattr(e, "filename", None) or where or "the workdir"
        what = first_line(e) if isinstance(e, JtrainError) else ""
        what = what.split(" failed:", 1)[0] if " failed:" in what else ""
        return DiskFullError(f"no space left on the device holding {place}"
                             + (f" ({what})" if what else "")
                             + f"; free space (or use another {flag}) and rerun the same "
                             "command" + (" to continue from the newest checkpoint"
                                          if flag == "--workdir" else ""))
    if isinstance(e, JtrainError):
        return e
    if isinstance(e, OSError) and e.errno in _NOT_WRITABLE:
        place = e.filename or where or "the workdir"
        return WorkdirError(f"{place}: {_NOT_WRITABLE[e.errno]}; choose another {flag}")
    return e


def exit_code(e: BaseException) -> int:
    return e.exit_code if isinstance(e, JtrainError) else 1


def render(e: BaseException, kind: str | None = None) -> str:
    """`jtrain: <kind> error: <first line>`: what a person sees for any exception,
    secrets masked."""
    from jtrain.redact import redact_text

    kind = kind or (e.kind if isinstance(e, JtrainError) else "internal")
    return redact_text(f"jtrain: {kind} error: {first_line(e)}")
