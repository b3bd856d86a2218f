"""Metric writers: JSONL (always), TensorBoard, optional MLflow and W&B; process 0 only.

All I/O happens in one background daemon thread per `MetricWriter`, so the training loop
never waits on a disk or a tracking server. Values become Python floats in the caller's
thread, so the writer thread never touches JAX. Every config and text is redacted first.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import threading
import time
from pathlib import Path

# Redaction lives beside the console output that needs it most; it is part of this API.
from jtrain import config as config_lib
from jtrain.observe import jsonl, tbx, writer_checks
from jtrain.observe import layout
from jtrain.redact import redact, redact_text

_MLFLOW_PARAM_MAX_LEN = 6000  # MLflow rejects longer parameter values.


def _flatten(tree: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}; leaves become bool/int/float/str."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        elif isinstance(v, (bool, int, float, str)):
            out[key] = v
        elif hasattr(v, "item") and getattr(v, "ndim", None) == 0:  # numpy scalar
            out[key] = v.item()
        else:
            out[key] = str(v)
    return out


def _cfg(log_cfg, key: str):
    """`log.<key>`; a partial section (tests, tools) falls back on the schema's default."""
    default = config_lib.SCHEMA["log"][key].default
    value = default if log_cfg is None else log_cfg.get(key, default)
    return default if value is None else value


class MissingExtraError(ImportError):
    """A writer named in log.writers needs a package that is not installed."""


def _import_extra(name: str):
    try:
        return __import__(name)
    except ImportError:
        raise MissingExtraError(
            f"log.writers: {name!r} needs the {name} package: pip install 'jtrain[{name}]'"
        ) from None


def check(workdir: str, log_cfg) -> None:
    """Before data, build or any step: each writer in log.writers can start (one-line
    ConfigError with the fix; jtrain.observe.writer_checks)."""
    names = _writer_names(log_cfg)
    for extra in ("mlflow", "wandb"):
        if extra in names:
            _import_extra(extra)
    writer_checks.check(workdir, log_cfg, names)


def _writer_names(log_cfg) -> tuple[str, ...]:
    names = _cfg(log_cfg, "writers")
    if isinstance(names, str):
        names = [n for n in names.split(",") if n.strip()]
    names = tuple(n.strip() for n in names)
    for n in names:
        if n not in config_lib.WRITERS:
            raise ValueError(f"log.writers: unknown writer {n!r}; "
                             f"choose from {config_lib.WRITERS}")
    return ("jsonl",) + tuple(n for n in dict.fromkeys(names) if n != "jsonl")


class _Backend:
    """No-op defaults; each backend overrides what it records. Runs in the writer thread."""

    name = "backend"

    def scalars(self, step: int, wall: float, scalars: dict) -> None: ...
    def hparams(self, tree: dict, flat: dict) -> None: ...
    def text(self, step: int, wall: float, key: str, text: str) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class _Jsonl(_Backend):
    name = "jsonl"

    def __init__(self, workdir: str, resumed_step: int | None = None):
        path = os.path.join(workdir, "metrics.jsonl")
        if resumed_step is not None and os.path.exists(path):
            jsonl.truncate_after(path, resumed_step)
        # A kill mid-line leaves a partial record; start ours on a fresh line.
        torn = os.path.exists(path) and os.path.getsize(path) > 0 and jsonl.last_byte(path) != b"\n"
        self._f = layout.open_append(path)
        if torn:
            self._f.write("\n")

    def scalars(self, step, wall, scalars):
        record = {"step": step, "time": wall}
        record.update({k: jsonl.json_float(v) for k, v in scalars.items()})
        self._f.write(json.dumps(record, allow_nan=False) + "\n")
        self._f.flush()  # cheap here (background thread); a kill loses nothing written

    def flush(self):
        self._f.flush()

    def close(self):
        self._f.close()


class _TensorBoard(_Backend):
    """Event files under WORKDIR/tb, written synchronously by this thread.

    tensorboardX's `SummaryWriter.flush()` does not drain its own queue; writing records
    with its `EventsWriter` makes `MetricWriter.flush()` mean "on disk".
    """

    name = "tensorboard"

    def __init__(self, workdir: str):
        tbx.import_without_torch()
        tbx.import_record_writer()
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto import event_pb2
        from tensorboardX import summary

        self._event_pb2, self._summary = event_pb2, summary
        logdir = os.path.join(workdir, "tb")
        os.makedirs(logdir, exist_ok=True)
        # The stock name has 1 s resolution: a resume within a second would overwrite.
        self._w = EventsWriter(os.path.join(logdir, "events"), f".{os.getpid()}.{time.time_ns()}")

    def _write(self, summary, step: int, wall: float):
        self._w.write_event(self._event_pb2.Event(summary=summary, step=step, wall_time=wall))

    def scalars(self, step, wall, scalars):
        for k, v in scalars.items():
            self._write(self._summary.scalar(k, v), step, wall)

    def hparams(self, tree, flat):
        for s in self._summary.hparams(flat, {}):
            self._write(s, 0, time.time())

    def text(self, step, wall, key, text):
        self._write(self._summary.text(key, text), step, wall)

    def flush(self):
        self._w.flush()

    def close(self):
        self._w.close()


class _MLflow(_Backend):
    name = "mlflow"

    def __init__(self, workdir: str, log_cfg, run_id: str | None, run_name: str | None):
        _import_extra("mlflow")
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.tracking import MlflowClient

        self._Metric, self._Param, self._RunTag = Metric, Param, RunTag
        uri = _cfg(log_cfg, "mlflow_tracking_uri")
        local = not uri
        if local:
            uri = "sqlite:///" + str(Path(workdir, "mlflow.db").resolve())
        self._client = MlflowClient(tracking_uri=uri)
        exp_name = _cfg(log_cfg, "mlflow_experiment")
        exp = self._client.get_experiment_by_name(exp_name)
        if exp is not None:
            exp_id = exp.experiment_id
        else:  # keep a local run's artifacts in the workdir, not in the current directory
            art = Path(workdir, "mlartifacts").resolve().as_uri() if local else None
            exp_id = self._client.create_experiment(exp_name, artifact_location=art)
        self._resumed = False
        if run_id:
            try:
                self._client.update_run(run_id, status="RUNNING")
                self._resumed = True
            except Exception as e:  # a moved workdir or another tracking server
                logging.warning("mlflow: cannot resume run %s (%s); starting a new run",
                                run_id, redact_text(str(e)).splitlines()[0])
        if not self._resumed:
            tags = {"jtrain.resumed_from": run_id} if run_id else None
            run_id = self._client.create_run(exp_id, run_name=run_name, tags=tags).info.run_id
        self.run_id = run_id

    def scalars(self, step, wall, scalars):
        ms = int(wall * 1000)
        metrics = [self._Metric(k, v, ms, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's per-call limit
            self._client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def hparams(self, tree, flat):
        params = {k: str(v)[:_MLFLOW_PARAM_MAX_LEN] for k, v in flat.items()}
        tags = []
        if self._resumed:  # MLflow forbids changing a logged param: record changes as tags
            old = self._client.get_run(self.run_id).data.params
            tags = [self._RunTag(f"jtrain.changed_param.{k}", v[:5000])
                    for k, v in params.items() if k in old and old[k] != v]
            params = {k: v for k, v in params.items() if k not in old}
        items = [self._Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self._client.log_batch(self.run_id, params=items[i:i + 100])
        for i in range(0, len(tags), 100):
            self._client.log_batch(self.run_id, tags=tags[i:i + 100])

    def text(self, step, wall, key, text):
        safe = re.sub(r"[^\w.-]+", "_", key).strip("._") or "text"
        self._client.log_text(self.run_id, text, f"text/{safe}/step_{step:08d}.txt")

    def close(self):
        self._client.set_terminated(self.run_id)


class _Wandb(_Backend):
    name = "wandb"

    def __init__(self, workdir: str, log_cfg, run_id: str | None, run_name: str | None):
        wandb = _import_extra("wandb")
        # console="off": W&B would otherwise copy all of stdout/stderr into its run files.
        settings = wandb.Settings(console="off")
        self._run = wandb.init(
            project=_cfg(log_cfg, "wandb_project"),
            mode=_cfg(log_cfg, "wandb_mode"),
            dir=workdir, id=run_id, resume="allow", name=run_name,
            reinit="create_new", settings=settings,
        )
        self.run_id = self._run.id

    def scalars(self, step, wall, scalars):
        self._run.log(dict(scalars), step=step)

    def hparams(self, tree, flat):
        self._run.config.update(tree, allow_val_change=True)

    def text(self, step, wall, key, text):
        self._run.log({key: text}, step=step)

    def close(self):
        self._run.finish()


class MetricWriter:
    """Writes scalars, the config and text to every backend in log.writers, off-thread.
    `resumed_step`: metrics.jsonl drops its records after that step, which the resumed
    run writes again (TensorBoard and the trackers keep both; the later one is current).

    On non-primary processes every method is a no-op and no file is created.
    """

    def __init__(self, workdir: str, log_cfg, *, is_primary: bool,
                 run_ids: dict | None = None, run_name: str | None = None,
                 resumed_step: int | None = None):
        self._ids = dict(run_ids or {})
        self._backends: list[_Backend] = []
        self._thread = None
        self._closed = False
        self._error = None  # (writer name, exception) of the first failure in the thread
        self._reported = False
        if not is_primary:
            return
        names = _writer_names(log_cfg)
        for extra in ("mlflow", "wandb"):  # fail before creating any file
            if extra in names:
                _import_extra(extra)
        os.makedirs(workdir, exist_ok=True)
        name = "jsonl"
        try:
            self._backends.append(_Jsonl(workdir, resumed_step))
            if "tensorboard" in names:
                name = "tensorboard"
                self._backends.append(_TensorBoard(workdir))
            for name, cls in (("mlflow", _MLflow), ("wandb", _Wandb)):
                if name in names:
                    backend = cls(workdir, log_cfg, self._ids.get(name), run_name)
                    self._backends.append(backend)
                    self._ids[name] = backend.run_id
        except BaseException as e:
            for backend in self._backends:
                backend.close()
            if name != "jsonl" and isinstance(e, Exception) and not isinstance(e, OSError):
                raise writer_checks.setup_error(name, e) from e
            raise
        self._queue: queue.Queue = queue.Queue()
        self._failed: set[str] = set()
        self._thread = threading.Thread(target=self._loop, name="jtrain-metric-writer",
                                        daemon=True)
        self._thread.start()

    # -- caller side ------------------------------------------------------------------
    def write_scalars(self, step: int, scalars: dict[str, float]) -> None:
        if not self._accepting():
            return
        values = {}
        for k, v in scalars.items():
            try:
                values[str(k)] = float(v)
            except (TypeError, ValueError):
                raise TypeError(f"write_scalars: {k!r} is not a scalar "
                                f"({type(v).__name__})") from None
        self._queue.put(("scalars", (int(step), time.time(), values)))

    def write_hparams(self, hparams: dict) -> None:
        if not self._accepting():
            return
        tree = redact(hparams)
        self._queue.put(("hparams", (tree, _flatten(tree))))

    def write_text(self, step: int, key: str, text: str) -> None:
        if not self._accepting():
            return
        self._queue.put(("text", (int(step), time.time(), redact_text(key), redact_text(text))))

    def fail(self, error: Exception) -> None:
        """The first backend fails with `error` at its next write, in the writer thread
        (debug.faults writer_fail): the caller hears of it as of any backend's failure."""
        if self._accepting():
            self._queue.put(("fail", error))

    def run_ids(self) -> dict:
        """Run ids of the tracking backends, to store in checkpoints for resuming."""
        return dict(self._ids)

    def flush(self) -> None:
        """Waits until everything enqueued so far is written; raises a thread error."""
        if self._thread is None:
            return
        done = threading.Event()
        self._queue.put(("flush", done))
        done.wait()
        self._raise_error()

    def close(self) -> None:
        """Flushes and closes every backend. Idempotent; raises a thread error once."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._queue.put(("close", ()))
            self._thread.join()
            self._thread = None
        self._raise_error()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _accepting(self) -> bool:
        if self._thread is None:
            if self._closed and self._backends:
                raise RuntimeError("MetricWriter is closed")
            return False
        self._raise_error()
        return True

    def _raise_error(self) -> None:
        if self._error is not None and not self._reported:
            self._reported = True
            name, e = self._error
            msg = redact_text(f"{type(e).__name__}: {e}").splitlines()[0]
            raise RuntimeError(f"metric writer {name!r} failed: {msg}") from e

    # -- writer thread: no JAX here, only Python floats and strings -----------------------
    def _loop(self) -> None:
        while True:
            op, args = self._queue.get()
            if op == "flush":
                self._call_all("flush", ())
                args.set()
            elif op == "fail":
                self._failed.add(self._backends[0].name)
                self._error = self._error or (self._backends[0].name, args)
            elif op == "close":
                self._call_all("flush", ())
                self._call_all("close", ())
                return
            else:
                self._call_all(op, args)

    def _call_all(self, op: str, args: tuple) -> None:
        for backend in self._backends:
            if backend.name in self._failed and op != "close":
                continue
            try:
                getattr(backend, op)(*args)
            except Exception as e:  # surfaced to the caller by the next call / flush / close
                self._failed.add(backend.name)
                if self._error is None:
                    self._error = (backend.name, e)
