"""Every error a user can cause, each with its exit code, and the one function that
renders any exception as the one line a person sees.

An error that names a key (a config key, a flag, a file, a dataset) is built from its
parts, `ConfigError(key, why)`, and keeps them as fields: `e.key`, `e.why`; the one
line is `jtrain: <kind> error: <key>: <why>`. One that names nothing is built from a
message, `DataError(message)` (`e.key` is None, `e.why` the message). Code that needs
the key reads `e.key`; no one parses an error's text.

`EXIT_CODES` says what each exit code means; docs/reference/exit_codes.md is written from it and
from the classes below (`python -m jtrain.cli.exit_codes --markdown`). Entry points print
`render(e)` on stderr and exit with `exit_code(e)`; no traceback for any of these.
`classify(e)` turns what libraries raise (OSError, orbax's wrapped I/O errors) into the
error that says what to change. Every rendered line passes through the redactor
(jtrain.redact).
"""

from __future__ import annotations

import errno
import os
import re

__all__ = ["CheckpointError", "ConfigError", "DataError", "DependencyError", "DiskFullError",
           "EvaluateError",
           "ExportError", "HangError", "JtrainError", "ModelError", "NonFiniteError",
           "PeerError", "RestoreError", "UsageError", "WorkdirError", "exit_code", "render"]

# What each exit code means, for every command (docs/reference/exit_codes.md).
EXIT_CODES = {
    0: "done, stopped early (early stopping, `on_eval`), or stopped by SIGTERM / SIGINT "
       "with the current step saved (a signal during start-up: nothing new to save); "
       "`--stopped_exit_code=N` makes a signal's stop exit N (e.g. 75 for Kubernetes)",
    1: "a bug in jtrain or in user code: `jtrain: internal error: ...`, its traceback in "
       "`WORKDIR/train.log`; an installed library whose private internals jtrain uses "
       "moved (`jtrain: dependency error: ...`); `--verify_resume` exits 1 on FAIL",
    2: "a bad config, data, model, command line or workdir: one line naming the key, "
       "file, field or model, before any training",
    3: "a checkpoint that cannot be restored (a changed config, another model, damaged "
       "with `--strict_restore`) or written; an export that cannot be written or read",
    4: "halted: non-finite loss or gradients (`nonfinite.*`) or repeated loss spikes "
       "(`spike.max_rollbacks`); or a run that ended with more than "
       "`nonfinite.max_skipped_share` of its updates skipped (its checkpoints kept)",
    5: "a hang (`watchdog.timeout_s`), no clean stop within `checkpoint.grace_seconds`, "
       "or a peer process missing at start-up, failed, silent or running another config "
       "(one line; the process leaves at once instead of waiting for the dead peer)",
    6: "disk full: no space left on the device holding the workdir, at any moment of the "
       "run (free space, rerun the same command to continue)",
    7: "`jtrain diff`: the two runs differ (config, data, library versions or state); "
       "`jtrain replay`: the step did not reproduce its recorded state hash",
}

# `jtrain diff` / `jtrain replay`: the runs or the replayed step differ (a result, not
# an error: the command ran and says where).
EXIT_DIFFERENT = 7


class JtrainError(Exception):
    """Base of jtrain's user-facing errors: `kind` names it in the one line.

    `JtrainError(key, why)` names what to change (`e.key`, `e.why`);
    `JtrainError(message)` names nothing (`e.key` is None, `e.why` is the message).
    str(e) is `<key>: <why>` or the message. Keyword arguments are further fields for
    the code that catches it (`RestoreError(..., changed_keys=[...], what=...)`).

    Examples:
        ```python
        import jtrain
        from jtrain.errors import JtrainError, render

        try:
            jtrain.train(config, "runs/a", train_data=data)
        except JtrainError as e:          # every error of jtrain's, with its fields
            print(render(e))              # jtrain: <kind> error: <key>: <why>
            raise SystemExit(e.exit_code)
        ```
    """

    kind = "jtrain"
    exit_code = 1

    def __init__(self, key_or_message: str = "", why: str | None = None, **fields):
        key = key_or_message if why is not None else None
        self.key: str | None = key
        self.why: str = key_or_message if why is None else why
        vars(self).update(fields)
        super().__init__(message(key, self.why))


def message(key: str | None, why: str) -> str:
    """The message of an error with these fields: `<key>: <why>`, or either alone."""
    if key is None:
        return why
    return f"{key}: {why}" if why else key


class ConfigError(JtrainError, ValueError):
    """A bad config key or value (`ConfigError(dotted.key, why)`), found before any
    training.

    Examples:
        ```python
        import jtrain
        from jtrain.errors import ConfigError, render

        try:
            jtrain.train({"optim": {"lr": -1.0}}, "runs/a")
        except ConfigError as e:
            print(e.key, e.why)  # optim.lr must be >= 0.0, got -1.0

        e = ConfigError("optim.lr", "must be >= 0.0, got -1.0")
        print(render(e))      # jtrain: config error: optim.lr: must be >= 0.0, got -1.0
        print(e.exit_code)    # 2 (the exit status of the command)
        ```
    """

    kind, exit_code = "config", 2

    def __init__(self, key: str, why: str = "", **fields):
        super().__init__(key, why, **fields)


class DataError(JtrainError, ValueError):
    """Bad input data: names the dataset and the item or field.

    Examples:
        ```python
        from jtrain.errors import DataError, render

        e = DataError("train_data", "item 7: targets is a str")
        print(render(e))      # jtrain: data error: train_data: item 7: targets is a str
        print(e.exit_code)    # 2 (the exit status of the command)
        ```
    """

    kind, exit_code = "data", 2


class ModelError(JtrainError, ValueError):
    """A model or step of the user's that jtrain cannot train as it is: names it and
    what to change.

    Examples:
        ```python
        from jtrain.errors import ModelError, render

        e = ModelError("model", "Net takes no inputs argument")
        print(render(e))      # jtrain: model error: model: Net takes no inputs argument
        print(e.exit_code)    # 2 (the exit status of the command)
        ```
    """

    kind, exit_code = "model", 2


class UsageError(JtrainError, ValueError):
    """A bad command line: an unknown flag, a missing or malformed argument.

    Examples:
        ```python
        from jtrain.errors import UsageError, render

        e = UsageError("--step", "expected an integer, got 'last'")
        print(render(e))      # jtrain: usage error: --step: expected an integer, got 'last'
        print(e.exit_code)    # 2 (the exit status of the command)
        ```
    """

    kind, exit_code = "usage", 2


def env_int(name: str, default: int, lo: int | None = None, hi: int | None = None) -> int:
    """The integer environment variable `name` (`default` when unset or blank); a
    UsageError naming it when it is not an integer in [lo, hi]."""
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    value = int(raw) if re.fullmatch(r"\s*-?[0-9]+\s*", raw) else None
    if value is None or (lo is not None and value < lo) or (hi is not None and value > hi):
        span = "" if lo is None else f" in [{lo}, {hi}]"
        raise UsageError(f"{name}={raw!r} in the environment: expected an integer{span}")
    return value


class EvaluateError(JtrainError, ValueError):
    """An evaluation that cannot be done as asked (no such step, no eval split).

    Examples:
        ```python
        from jtrain.errors import EvaluateError, render

        e = EvaluateError("--step", "no checkpoint at step 500")
        print(render(e))      # jtrain: evaluate error: --step: no checkpoint at step 500
        print(e.exit_code)    # 2 (the exit status of the command)
        ```
    """

    kind, exit_code = "evaluate", 2


class WorkdirError(JtrainError):
    """The workdir (or an output directory) cannot hold a run: a file, a read-only file
    system, no permission; found before anything is written. Or a run opened by evaluate,
    replay or report whose config.json names code the user has not trusted (`jtrain
    trust RUN`), found before anything it names is imported.

    Examples:
        ```python
        from jtrain.errors import WorkdirError, render

        e = WorkdirError("runs/a", "is a file; choose another --workdir")
        print(render(e))      # jtrain: workdir error: runs/a: is a file; choose another --workdir
        print(e.exit_code)    # 2 (the exit status of the command)
        ```
    """

    kind, exit_code = "workdir", 2


class RestoreError(JtrainError):
    """A checkpoint that cannot be used as asked: damaged with `--strict_restore`,
    another model, a changed config.

    Examples:
        ```python
        from jtrain.errors import RestoreError, render

        e = RestoreError("checkpoint", "another model (model.hidden)")
        print(render(e))      # jtrain: restore error: checkpoint: another model (model.hidden)
        print(e.exit_code)    # 3 (the exit status of the command)
        ```
    """

    kind, exit_code = "restore", 3


class ExportError(JtrainError):
    """An export that cannot be written or read.

    Examples:
        ```python
        from jtrain.errors import ExportError, render

        e = ExportError("export", "no checkpoint in runs/a")
        print(render(e))      # jtrain: export error: export: no checkpoint in runs/a
        print(e.exit_code)    # 3 (the exit status of the command)
        ```
    """

    kind, exit_code = "export", 3


class CheckpointError(JtrainError):
    """A checkpoint write that failed (possibly in the background).

    Examples:
        ```python
        from jtrain.errors import CheckpointError, render

        e = CheckpointError("checkpoint", "the write of step 200 failed")
        print(render(e))      # jtrain: checkpoint error: checkpoint: the write of step 200 failed
        print(e.exit_code)    # 3 (the exit status of the command)
        ```
    """

    kind, exit_code = "checkpoint", 3


class NonFiniteError(JtrainError):
    """Training halted on a non-finite loss or gradient (`nonfinite.policy=halt`, or
    `nonfinite.max_consecutive` skips in a row), or a run ended with more than
    `nonfinite.max_skipped_share` of its updates skipped (checkpoints kept).

    Examples:
        ```python
        from jtrain.errors import NonFiniteError, render

        e = NonFiniteError("nonfinite.policy", "the loss is NaN at step 31")
        print(render(e))  # jtrain: non-finite error: nonfinite.policy: the loss is NaN at step 31
        print(e.exit_code)    # 4 (the exit status of the command)
        ```
    """

    kind, exit_code = "non-finite", 4


class HangError(JtrainError):
    """A step, eval or save took longer than `watchdog.timeout_s`. The watchdog renders
    it and exits the process itself (a stuck thread cannot raise).

    Examples:
        ```python
        from jtrain.errors import HangError, render

        e = HangError("watchdog.timeout_s", "step 12 took over 600 s")
        print(render(e))      # jtrain: hang error: watchdog.timeout_s: step 12 took over 600 s
        print(e.exit_code)    # 5 (the exit status of the command)
        ```
    """

    kind, exit_code = "hang", 5


class PeerError(JtrainError):
    """A collective with the other processes failed: a peer died or hung up.

    Examples:
        ```python
        from jtrain.errors import PeerError, render

        e = PeerError("process 1 stopped answering")
        print(render(e))      # jtrain: peer error: process 1 stopped answering
        print(e.exit_code)    # 5 (the exit status of the command)
        ```
    """

    kind, exit_code = "peer", 5


class DiskFullError(JtrainError):
    """No space left on the device (ENOSPC) while writing the run's files: free space,
    rerun the same command to continue from the newest checkpoint.

    Examples:
        ```python
        from jtrain.errors import DiskFullError, render

        e = DiskFullError("no space left on the device holding runs/a")
        print(render(e))      # jtrain: disk error: no space left on the device holding runs/a
        print(e.exit_code)    # 6 (the exit status of the command)
        ```
    """

    kind, exit_code = "disk", 6


class DependencyError(JtrainError):
    """An installed library moved a private part jtrain uses (jtrain.internals): the key
    names the library and its version. Install the versions of constraints.txt.

    Examples:
        ```python
        from jtrain.errors import DependencyError, render

        e = DependencyError("grain 0.3.0", "a private attribute of grain.DataLoader moved")
        print(render(e))      # jtrain: dependency error: grain 0.3.0: a private ...
        print(e.exit_code)    # 1 (the exit status of the command)
        ```
    """

    kind, exit_code = "dependency", 1


# Every error class above, in the order docs/reference/exit_codes.md lists them.
ERRORS = (ConfigError, DataError, ModelError, UsageError, EvaluateError, WorkdirError,
          RestoreError, ExportError, CheckpointError, NonFiniteError, HangError, PeerError,
          DiskFullError, DependencyError)


def first_line(e: BaseException) -> str:
    """The first non-empty line of an exception's message, or its type's name."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# What a write that failed for lack of space says, wherever it was raised: Python's
# OSError, or tensorstore's status text inside orbax's errors.
_NO_SPACE = ("No space left on device", "os_error_code='28'", "[Errno 28]")
_NOT_WRITABLE = {errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                 errno.EPERM: "operation not permitted", errno.ENOTDIR: "not a directory",
                 errno.EEXIST: "exists and is not a directory"}


def classify(e: BaseException, where: str = "", flag: str = "--workdir") -> BaseException:
    """The JtrainError a person should see for `e` (`e` itself when nothing fits).

    ENOSPC anywhere (an OSError, or orbax's error around tensorstore's) is a
    DiskFullError naming what was being written (a CheckpointError's field `what`); a write
    refused by the file system is a WorkdirError naming the path."""
    chain = [e, e.__cause__, e.__context__]
    said = " ".join(str(c) for c in chain if c is not None)
    no_space = any(isinstance(c, OSError) and c.errno == errno.ENOSPC for c in chain)
    if no_space or any(m in said for m in _NO_SPACE):
        place = getattr(e, "filename", None) or where or "the workdir"
        what = getattr(e, "what", "") if isinstance(e, JtrainError) else ""
        return DiskFullError(f"no space left on the device holding {place}"
                             + (f" ({what})" if what else "")
                             + f"; free space (or use another {flag}) and rerun the same "
                             "command" + (" to continue from the newest checkpoint"
                                          if flag == "--workdir" else ""))
    if isinstance(e, JtrainError):
        return e
    if isinstance(e, OSError) and e.errno in _NOT_WRITABLE:
        place = e.filename or where or "the workdir"
        return WorkdirError(place, f"{_NOT_WRITABLE[e.errno]}; choose another {flag}")
    return e


def exit_code(e: BaseException) -> int:
    """The exit status a command ends with for `e`: the error class's `exit_code`
    (docs/reference/exit_codes.md), 1 for any other exception.

    Examples:
        ```python
        from jtrain.errors import PeerError, exit_code

        exit_code(PeerError("process 1 stopped answering"))   # 5
        exit_code(ValueError("boom"))                         # 1
        ```
    """
    return e.exit_code if isinstance(e, JtrainError) else 1


def render(e: BaseException, kind: str | None = None) -> str:
    """`jtrain: <kind> error: <key>: <why>` (a jtrain error, from its fields) or
    `jtrain: <kind> error: <first line>` (any other exception): what a person sees,
    secrets masked.

    Examples:
        ```python
        from jtrain.errors import ConfigError, render

        render(ConfigError("optim.lr", "must be >= 0.0"))  # 'jtrain: config error: optim.lr: ...'
        render(ValueError("boom"))                          # 'jtrain: internal error: boom'
        ```
    """
    from jtrain.redact import redact_text

    if isinstance(e, JtrainError):
        said = message(e.key, e.why).strip()
        line = said.splitlines()[0] if said else type(e).__name__
    else:
        line = first_line(e)
    kind = kind or (e.kind if isinstance(e, JtrainError) else "internal")
    return redact_text(f"jtrain: {kind} error: {line}")
