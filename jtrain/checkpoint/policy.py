"""Checkpoint policies: which checkpoints to keep, and how hard a background write may
compete with training for the CPU. Used by `jtrain.checkpoint.Checkpointer`."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np


@dataclasses.dataclass
class KeepPolicy:
    """Which checkpoints to keep (orbax's PreservationPolicy protocol): exactly the
    latest `max_to_keep` (at least 1: the latest is never deleted to make room for a
    better one) ∪ multiples of `keep_every_steps` ∪ the `keep_top_k` best by `monitor`
    (`mode`) in the registry of the owner's run-control record ∪ the owner's `held`
    steps (eval.mode=async: evaluation points whose eval was not applied yet). The owner
    is read at call time: its record is replaced on resume."""

    owner: Any  # jtrain.checkpoint.Checkpointer

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        cfg = self.owner.cfg
        steps = [info.step for info in checkpoints]
        keep = set(steps[-max(1, cfg.max_to_keep):])
        if cfg.keep_every_steps:
            keep |= {s for s in steps if s % cfg.keep_every_steps == 0}
        keep |= set(best_steps(self.owner.control.metric_registry, steps, cfg.keep_top_k,
                               cfg.mode))
        keep |= set(self.owner.held)  # eval.mode=async: not evaluated and applied yet
        return [s in keep for s in steps]


def best_steps(registry: dict, steps, k: int, mode: str) -> list[int]:
    """The k best of `steps` by their registered metric (ties: the newer step)."""
    scored = [(float(registry[str(s)]), s) for s in steps
              if str(s) in registry and np.isfinite(float(registry[str(s)]))]
    sign = 1.0 if mode == "min" else -1.0
    scored.sort(key=lambda vs: (sign * vs[0], -vs[1]))
    return [s for _, s in scored[:k]]


def best_logged_step(workdir: str, steps, monitor: str, mode: str) -> int | None:
    """The best of `steps` by `monitor` as logged in WORKDIR/metrics.jsonl (`mode` min or
    max, ties to the newer step: the rule retention uses); None when none is logged.
    `--step=best` of evaluate and export, `init.step=best`."""
    from jtrain.observe import jsonl

    registry = {}
    for record in jsonl.read_records(os.path.join(workdir, "metrics.jsonl")):
        if isinstance(record.get(monitor), (int, float)) and "step" in record:
            registry[str(int(record["step"]))] = float(record[monitor])
    best = best_steps(registry, steps, 1, mode)
    return best[0] if best else None


WRITER_NICE_ENV = "JTRAIN_WRITER_NICE"  # the background writer's nice value (19)


def lower_writer_priority(nice: int, tid: int | None = None) -> None:
    """Renice tensorstore's I/O pool threads (or thread `tid`) to `nice` (Linux).

    JTRAIN_WRITER_NICE: with the CPU busy training, a background write takes cycles
    from the step; a higher nice value spreads the write over the cycles the step leaves
    idle (steps/s stays up, the write takes longer). A save after the loop stopped
    (final, preemption) or one the loop waits for competes with nothing."""
    if tid is not None:
        tids = [tid]
    else:
        try:
            names = os.listdir("/proc/self/task")
        except OSError:  # not Linux
            return
        tids = []
        for name in names:
            try:
                with open(f"/proc/self/task/{name}/comm") as f:
                    if f.read().startswith("ts_pool"):
                        tids.append(int(name))
            except OSError:  # the thread ended meanwhile
                pass
    lower_priority(nice, tids)


def lower_priority(nice: int, tids) -> None:
    """Threads `tids` (Linux thread ids) reniced to `nice`, never raised above it; a
    thread that ended meanwhile or may not be reniced is passed over. Threads a thread
    starts afterwards inherit its value."""
    for t in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, t) < nice:
                os.setpriority(os.PRIO_PROCESS, t, nice)
        except OSError:
            pass
