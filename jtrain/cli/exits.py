"""How a jtrain command ends: the one line and exit code of a failure, the peers of a
multi-process run told, and the fast exit after a finished run. Used by `cli.run`, the
one error and exit path of every command.

    fail(e, workdir)   a failure: its one line on stderr (its traceback too if it is a
                       bug: in WORKDIR/train.log when the command has one), peers told
                       -> the exit code
    done(code)         a command that returned `code` (a stop may be non-zero) -> code
    exit_now(code)     the process ends here: os._exit after a finished run

In a multi-process run every process records its exit status in JAX's key-value store
(jtrain.multihost.heartbeat), so peers that end a little later report that status
instead of a dead process, and process 0 leaves last; a process with a non-zero code
leaves at once (os._exit): jax.distributed's shutdown at exit would wait for peers that
may be gone.
"""

from __future__ import annotations

import os
import sys
import traceback

from jtrain import errors

EXIT_LINGER_S = 5.0  # process 0, failing: how long it waits for its peers to leave first


def fail(e: BaseException, workdir: str = "") -> int:
    """`e`'s one line on stderr (its traceback too if it is a bug: in WORKDIR/train.log
    when the command has one); the exit code, after telling the peers."""
    known = _peer_failure(e) or errors.classify(e, workdir)
    line = errors.render(known)
    if isinstance(known, errors.JtrainError):
        if workdir and os.path.isfile(os.path.join(workdir, "train.log")):
            from jtrain.observe import (
                liblogs,  # once the run has a log, it has the line
            )

            liblogs.append_traceback(workdir, line, known)
    else:
        from jtrain.observe import liblogs

        if liblogs.append_traceback(workdir or None, line, known):
            line += f" (traceback in {os.path.join(workdir, liblogs.LOG_FILE)})"
        else:
            traceback.print_exception(type(known), known, known.__traceback__)
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    code = errors.exit_code(known)
    from jtrain.multihost import (
        heartbeat,  # peers report this status, not a dead process
    )

    heartbeat.finished(code, linger_s=EXIT_LINGER_S)  # process 0 leaves last
    return _leave(code)


def done(code: int) -> int:
    """A command that returned `code`: a stop is no failure (every process stops at the
    same step), so peers still saving are told 0 whatever the code; process 0 leaves
    last when it exits at once."""
    from jtrain.multihost import heartbeat

    heartbeat.finished(0, linger_s=EXIT_LINGER_S if code else 0.0)
    return _leave(code)


def _leave(code: int) -> int:
    if code and _multi_process():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def exit_now(code: int = 0) -> None:
    """After a finished command, a fast exit: everything a run writes is closed and
    flushed by then (checkpoints waited for, writers and logs closed), and the
    interpreter's own teardown of JAX's backend and compiled programs took 1 s here on an
    idle machine (10 s under load) for nothing."""
    import logging

    if code:
        raise SystemExit(code)
    if _multi_process():  # the shutdown barrier: process 0's coordination service must
        import jax  # outlive its peers' disconnect (as at a normal exit)

        jax.distributed.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)


def _multi_process() -> bool:
    jax = sys.modules.get("jax")
    try:
        return jax is not None and jax.distributed.is_initialized() and \
            jax.process_count() > 1
    except Exception:  # noqa: BLE001 - no backend: one process
        return False


def _peer_failure(e: BaseException) -> errors.PeerError | None:
    """A runtime error in a multi-process run that is a failed collective."""
    jax = sys.modules.get("jax")
    if jax is None or not _multi_process() or not isinstance(e, jax.errors.JaxRuntimeError):
        return None
    first = errors.first_line(e)
    if "RESOURCE_EXHAUSTED" in first:  # out of memory: not a peer's fault
        return None
    from jtrain.multihost import heartbeat

    heartbeat.peer_failed()  # the peer monitor names the peer and exits 5, if it can
    return errors.PeerError(f"a collective with the other processes failed ({first[:200]});"
                            " another process probably stopped: see its output; a "
                            "restart resumes from the newest checkpoint")
