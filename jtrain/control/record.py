"""The run-control record every checkpoint carries: enough to continue the run's
bookkeeping exactly (config and hash, versions, writer run ids, best-k registry, eval
history, accepted config changes). Plain JSON; no pickling anywhere."""

from __future__ import annotations

import dataclasses
import sys

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
    stopped_by: str | None = None  # SIGTERM, SIGINT, early_stop, on_eval
    # Early stopping and plateau state ({"early_stop": ..., "plateau": ...}, see
    # jtrain.control.monitors) and the skip ledger (jtrain.control.ledger).
    monitors: dict = dataclasses.field(default_factory=dict)
    skip_ledger: list = dataclasses.field(default_factory=list)

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


