"""Host-side run control: preemption signals, the run-control record that every
checkpoint carries, and the config diff checked on resume. Reads nothing from devices.

Preemption: `Stopper` turns SIGTERM and SIGINT into "stop after the current step": the
loop saves a checkpoint of the state it has and `train()` returns normally, so the CLI
exits 0 (for both signals; the summary records which). A second SIGINT aborts at once
(KeyboardInterrupt, no final save). After the first signal the run has
`checkpoint.grace_seconds` to finish; past it the process exits 1 with one line, and the
newest finished checkpoint is what a restart resumes from. With several processes
(jax.distributed) SIGTERM belongs to JAX's preemption notifier, and every process stops
at the step `multihost_utils.reached_preemption_sync_point` names; a SIGINT on any
process is shared every `SYNC_EVERY` steps, so all processes stop at the same step.

Fault injection for `--verify_resume` and the tests (never set it by hand):
JTRAIN_FAULT=`step:N` SIGKILLs this process right after its N-th step was dispatched,
`eval:N` shortly after its N-th evaluation began, `save:N` while its N-th checkpoint is
being written in the background; `step:N:TERM` (or `:INT`) sends that signal instead.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import signal
import sys
import threading
import time
from typing import Any

SYNC_EVERY = 10  # steps between multi-process agreements on host-side decisions
FAULT_ENV = "JTRAIN_FAULT"
# Negative control of --verify_resume: restarts ignore the saved data position.
SKIP_DATA_RESTORE_ENV = "JTRAIN_SKIP_DATA_RESTORE"

# Config keys that cannot change the trained state (or, for mesh.*, only the float
# reduction order: restoring onto another mesh is supported): they may differ on resume
# without being allowed; they are still recorded. data.num_workers: map-style positions
# do not depend on it, and jtrain.data refuses (data.num_workers) where they would.
HARMLESS_PREFIXES = ("log.", "eval.", "checkpoint.", "profile.", "perf.", "mesh.",
                     "max_steps_in_flight", "data.num_workers", "data.num_threads",
                     "data.prefetch", "data.device_prefetch")


class StopRequested(Exception):
    """Raised inside `Stopper.interruptible()` when a stop signal arrives."""


# -- fault injection ------------------------------------------------------------------

_fault_counts: dict[str, int] = {}


def fault_point(kind: str, delay: float = 0.0) -> None:
    """At the N-th `kind` event, when JTRAIN_FAULT=`kind:N[:SIG]`, send this process
    SIGKILL (or SIGTERM / SIGINT for SIG = TERM / INT), after `delay` seconds."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    parts = spec.split(":")
    want, n, sig = parts[0], (parts[1:2] or ["1"])[0], (parts[2:3] or ["KILL"])[0]
    if want != kind:
        return
    _fault_counts[kind] = _fault_counts.get(kind, 0) + 1
    if _fault_counts[kind] != int(n):
        return
    signum = getattr(signal, f"SIG{sig}")
    if delay <= 0:
        os.kill(os.getpid(), signum)
    else:
        threading.Timer(delay, os.kill, (os.getpid(), signum)).start()


# -- signals --------------------------------------------------------------------------


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
        import jax

        self._multi = jax.process_count() > 1
        if threading.current_thread() is threading.main_thread():
            # Under jax.distributed, SIGTERM is JAX's (preemption notifier): leave it.
            sigs = (signal.SIGINT,) if self._multi else (signal.SIGTERM, signal.SIGINT)
            for sig in sigs:
                self._previous[sig] = signal.signal(sig, self._handle)
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
        self._request(name)
        # os.write: the handler may interrupt a print to sys.stderr (not reentrant).
        os.write(2, (f"\njtrain: {name} received: saving a checkpoint of the current step "
                     f"and stopping (within {self.grace_seconds:g} s"
                     + ("; Ctrl-C again aborts without saving" if name == "SIGINT" else "")
                     + ")\n").encode())
        if self._interruptible:
            raise StopRequested(name)

    def _request(self, name: str) -> None:
        if self.signal_name is not None:
            return
        self.signal_name = name
        if self.grace_seconds > 0:
            self._watchdog = threading.Timer(self.grace_seconds, self._grace_expired)
            self._watchdog.daemon = True
            self._watchdog.start()

    def _grace_expired(self) -> None:
        sys.stderr.write(f"jtrain: preemption error: no clean stop within the "
                         f"{self.grace_seconds:g} s grace period (checkpoint.grace_seconds); "
                         "exiting; a restart resumes from the newest finished checkpoint\n")
        sys.stderr.flush()
        os._exit(1)

    def request(self, name: str = "request") -> None:
        """Ask the loop to stop after the current step, as a signal would."""
        self._request(name)

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
        finally:
            self._interruptible = False

    def should_stop(self, step: int) -> bool:
        """True when the run must stop after `step`; the same on every process."""
        fault_point("step")
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


# -- run-control record ----------------------------------------------------------------


@dataclasses.dataclass
class RunControl:
    """What a checkpoint holds besides arrays and the data position: enough to continue
    the run's bookkeeping exactly. Plain JSON; no pickling anywhere."""

    config: dict  # the resolved config, secrets redacted
    config_sha256: str
    data_info: dict  # dataset name, size, fingerprint
    versions: dict
    writer_run_ids: dict = dataclasses.field(default_factory=dict)
    # Best-k registry: {step (str): monitored eval value} of evaluated checkpoints.
    metric_registry: dict = dataclasses.field(default_factory=dict)
    eval_history: list = dataclasses.field(default_factory=list)  # last evaluations
    config_changes: list = dataclasses.field(default_factory=list)  # accepted on resume
    counters: dict = dataclasses.field(default_factory=dict)  # early stopping, plateau, ...
    stopped_by: str | None = None

    HISTORY_KEEP = 100

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "RunControl":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def record_eval(self, step: int, metrics: dict, monitor: str) -> None:
        entry = {"step": int(step), **{k: float(v) for k, v in metrics.items()
                                       if k != "step" and _is_number(v)}}
        self.eval_history = (self.eval_history + [entry])[-self.HISTORY_KEEP:]
        if monitor in entry:
            self.metric_registry[str(int(step))] = entry[monitor]


def writer_run_ids(control: RunControl | None) -> dict | None:
    """Run ids of the metric writers (MLflow, W&B) to resume, from the restored record:
    pass as `MetricWriter(..., run_ids=...)`, and store `writer.run_ids()` back in
    `control.writer_run_ids` once the writer exists."""
    return dict(control.writer_run_ids) if control is not None else None


def _is_number(v) -> bool:
    try:
        float(v)
        return True
    except (TypeError, ValueError):
        return False


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for pkg in ("jtrain", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


# -- config changes on resume ----------------------------------------------------------


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


_ABSENT = "(absent)"


def config_changes(saved: dict, current: dict) -> dict[str, tuple]:
    """{dotted key: (saved value, current value)} for every key that differs."""
    a, b = flatten(saved), flatten(json.loads(json.dumps(current, default=str)))
    out = {}
    for key in sorted(set(a) | set(b)):
        old, new = a.get(key, _ABSENT), b.get(key, _ABSENT)
        if old != new:
            out[key] = (old, new)
    return out


def schedule_uses_total_steps(config: dict) -> bool:
    optim = config.get("optim", {})
    return optim.get("decay_steps", 0) == 0 and optim.get("schedule") not in ("constant", "rsqrt")


def unallowed_changes(changes: dict, allowed, config: dict) -> list[str]:
    """The changed keys that need `checkpoint.allow_changes` (fnmatch patterns)."""
    out = []
    for key in changes:
        if key.startswith(HARMLESS_PREFIXES):
            continue
        if key == "total_steps" and not schedule_uses_total_steps(config):
            continue  # extending (or shortening) a run whose schedule ignores it
        if any(fnmatch.fnmatchcase(key, pattern) for pattern in allowed):
            continue
        out.append(key)
    return out


def describe_changes(changes: dict, keys) -> str:
    def show(v):
        return v if v == _ABSENT else json.dumps(v)

    return ", ".join(f"{k} {show(changes[k][0])} -> {show(changes[k][1])}" for k in keys)
