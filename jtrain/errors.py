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

Entry points print `render(e)` on stderr and exit with `exit_code(e)`; no traceback for
any of these.
"""

from __future__ import annotations


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


def exit_code(e: BaseException) -> int:
    return e.exit_code if isinstance(e, JtrainError) else 1


def render(e: BaseException, kind: str | None = None) -> str:
    """`jtrain: <kind> error: <first line>`: what a person sees for any exception."""
    kind = kind or (e.kind if isinstance(e, JtrainError) else "internal")
    return f"jtrain: {kind} error: {first_line(e)}"
