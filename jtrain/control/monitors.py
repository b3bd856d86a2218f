"""Decisions taken on eval metrics: early stopping and ReduceLROnPlateau.

Both are plain host-side state machines fed one evaluation at a time with the globally
reduced eval metrics (`jtrain.engine.evaluation` reduces over all processes), so every process
would decide the same; the loop still broadcasts process 0's decision (`agree`) so that
float noise or a user hook can never split them. Their state is JSON and lives in the
checkpoint's run-control record (`RunControl.monitors`): a run killed between evals and
resumed re-runs the same evals from the same state and stops at the same step.

Early stopping (`early_stop.*`, Lightning's rules): an eval improves when it beats the
best by more than `min_delta` (only patience reads that margin: the best reported is the
best eval seen, see `Best`); `patience` evals in a row without improvement stop the
run; so do `stopping_threshold` (good enough), `divergence_threshold` (hopeless) and,
with `check_finite`, a NaN or infinite value.

ReduceLROnPlateau (`plateau.*`, PyTorch's rules with an absolute `min_delta`): more than
`patience` evals without improvement multiply the learning-rate factor by `factor`, then
`cooldown` evals are ignored; `optim.lr * factor` never goes below `min_lr`. The factor
is `TrainState.lr_factor`: it scales the whole update inside the jitted step (for the
optimizers here, exactly what scaling the learning rate does), composed with the
schedule, so `train/lr` logs the effective rate and no recompile happens. optax's
`contrib.reduce_on_plateau` was not used: it is driven by a value passed to every
`update` (the train loss) and counts update calls, not evaluations.

Loss spikes (`spike.*`, `Spike`): the train loss of every step, read when the loop
drains it, against the mean and standard deviation of the last `window` kept steps; the
loop rolls back (jtrain.engine.loop). Losses are global values, so every process sees the same
spike at the same step; the window is in the checkpoint like the rest.
"""

from __future__ import annotations

import dataclasses
import math

from jtrain.control import ledger as ledger_lib
from jtrain.control.rule import Action, Rule, halt


@dataclasses.dataclass
class Best:
    """The best value of a metric so far and the evals since it last improved.

    Two things, kept apart: `value` / `step` is the best eval seen (ties go to the newer
    step, the rule of checkpoint retention and `--step=best`), what the summary reports;
    `reference` is the value an eval must beat by more than `min_delta` to count as an
    improvement, which only restarts patience (`bad_evals`). A gain below `min_delta`
    moves the best, not the reference: small gains add up against the reference, as in
    Lightning and PyTorch."""
    mode: str  # "min" | "max"
    min_delta: float
    value: float | None = None
    step: int | None = None
    bad_evals: int = 0
    reference: float | None = None

    def _beats(self, value: float, than: float, margin: float) -> bool:
        return value < than - margin if self.mode == "min" else value > than + margin

    def update(self, step: int, value: float) -> bool:
        """Record one eval; True when it improved on the reference by more than min_delta."""
        if not math.isfinite(value):
            self.bad_evals += 1
            return False
        if self.value is None or not self._beats(self.value, value, 0.0):
            self.value, self.step = value, step
        if self.reference is None or self._beats(value, self.reference, self.min_delta):
            self.reference, self.bad_evals = value, 0
            return True
        self.bad_evals += 1
        return False

    def to_json(self) -> dict:
        return {"value": self.value, "step": self.step, "bad_evals": self.bad_evals,
                "reference": self.reference}

    def load(self, d: dict | None) -> None:
        if d:
            self.value, self.step, self.bad_evals = d["value"], d["step"], d["bad_evals"]
            # A state saved before the two were kept apart: its value was the reference.
            self.reference = d.get("reference", d["value"])


def monitored(metrics: dict, key: str) -> float:
    """The monitored value; KeyError names what the eval produced instead."""
    if key not in metrics:
        have = ", ".join(sorted(k for k in metrics if k != "step")) or "nothing"
        raise KeyError(f"{key} is not an eval metric of this run (it has: {have})")
    return float(metrics[key])


class EarlyStopping(Rule):
    """`update(step, metrics)` -> None, or the reason to stop now (one line)."""
    name = stopped_by = "early_stop"

    def __init__(self, cfg, state: dict | None = None):
        self.cfg = cfg
        self.restore(state)

    @classmethod
    def from_config(cls, cfg) -> "EarlyStopping":
        return cls(cfg.early_stop)

    def after_eval(self, step, eval_metrics):
        reason = self.update(step, eval_metrics)
        return Action(stop=reason) if reason else None

    def state(self) -> dict:
        return self.to_json()

    def restore(self, state: dict | None) -> None:
        self.best = Best(self.cfg.mode, float(self.cfg.min_delta))
        self.best.load((state or {}).get("best"))

    @property
    def enabled(self) -> bool:
        return bool(self.cfg.monitor)

    def update(self, step: int, metrics: dict) -> str | None:
        if not self.enabled:
            return None
        key, cfg = self.cfg.monitor, self.cfg
        value = monitored(metrics, key)
        if not math.isfinite(value):
            self.best.bad_evals += 1
            return f"{key} is {value} (early_stop.check_finite)" if cfg.check_finite else None
        self.best.update(step, value)
        lower = cfg.mode == "min"
        if cfg.stopping_threshold is not None and (
                value <= cfg.stopping_threshold if lower else value >= cfg.stopping_threshold):
            return (f"{key} {value:.6g} reached early_stop.stopping_threshold="
                    f"{cfg.stopping_threshold:g}")
        if cfg.divergence_threshold is not None and (
                value > cfg.divergence_threshold if lower else value < cfg.divergence_threshold):
            return (f"{key} {value:.6g} is past early_stop.divergence_threshold="
                    f"{cfg.divergence_threshold:g}")
        if self.best.bad_evals >= cfg.patience:
            return (f"{key} did not improve by more than {cfg.min_delta:g} in "
                    f"{self.best.bad_evals} evals (early_stop.patience={cfg.patience})")
        return None

    def to_json(self) -> dict:
        return {"best": self.best.to_json()}


class Plateau(Rule):
    """`update(step, metrics)` -> the new learning-rate factor, or None if unchanged."""
    name = "plateau"

    def __init__(self, cfg, peak_lr: float, state: dict | None = None):
        self.cfg, self.peak_lr = cfg, float(peak_lr)
        self.restore(state)

    @classmethod
    def from_config(cls, cfg) -> "Plateau":
        return cls(cfg.plateau, cfg.optim.lr)

    @property
    def lr_scale(self) -> float:  # type: ignore[override]
        return self.factor

    def after_eval(self, step, eval_metrics):
        before = self.factor
        new = self.update(step, eval_metrics)
        return None if new is None else Action(lr_factor=new / before)

    def state(self) -> dict:
        return self.to_json()

    def restore(self, state: dict | None) -> None:
        state = state or {}
        self.best = Best(self.cfg.mode, float(self.cfg.min_delta))
        self.best.load(state.get("best"))
        self.factor = float(state.get("factor", 1.0))
        self.cooldown_left = int(state.get("cooldown_left", 0))
        self.reductions = list(state.get("reductions", []))  # [(step, factor)]

    @property
    def enabled(self) -> bool:
        return bool(self.cfg.monitor)

    def update(self, step: int, metrics: dict) -> float | None:
        if not self.enabled:
            return None
        self.best.update(step, monitored(metrics, self.cfg.monitor))
        if self.cooldown_left > 0:
            self.cooldown_left -= 1
            self.best.bad_evals = 0
        if self.best.bad_evals <= self.cfg.patience:
            return None
        self.best.bad_evals = 0
        floor = self.cfg.min_lr / self.peak_lr if self.peak_lr > 0 else 0.0
        new = max(self.factor * self.cfg.factor, floor)
        if new >= self.factor:  # already at min_lr
            return None
        self.factor, self.cooldown_left = new, self.cfg.cooldown
        self.reductions.append([int(step), new])
        return new

    def to_json(self) -> dict:
        return {"best": self.best.to_json(), "factor": self.factor,
                "cooldown_left": self.cooldown_left, "reductions": self.reductions}


class Spike(Rule):
    """`check(step, loss)` -> the loss's z-score when it is a spike, else None (and the
    loss joins the window). The window holds the last `spike.window` finite losses of
    steps that were kept; a rollback to step c drops the losses of steps after c."""
    name = "spike"

    def __init__(self, cfg, state: dict | None = None):
        self.cfg = cfg
        self.restore(state)

    @classmethod
    def from_config(cls, cfg) -> "Spike":
        return cls(cfg.spike)

    @property
    def lr_scale(self) -> float:  # type: ignore[override]
        return self.scale

    def after_step(self, step, metrics):
        """A spike: roll back (the loop); one after spike.max_rollbacks: the halt."""
        if metrics["train/status"]:  # a skipped update: the non-finite policy's
            return None
        loss = metrics["train/loss"]
        z = self.check(step, loss)
        if z is None:
            return None
        if len(self.rollbacks) >= self.cfg.max_rollbacks:
            raise halt(f"training halted at step {step}: the train loss spiked again "
                       f"(loss {loss:.4g}, z-score {z:.3g}) after {len(self.rollbacks)} "
                       "rollbacks (spike.max_rollbacks); lower optim.lr or check the data "
                       f"in WORKDIR/{ledger_lib.FILE}", step)
        return Action(rollback=z)

    def state(self) -> dict:
        return self.to_json()

    def restore(self, state: dict | None) -> None:
        state = state or {}
        self.recent = [(int(s), float(v)) for s, v in state.get("recent", [])]
        self.rollbacks = [list(r) for r in state.get("rollbacks", [])]  # [spike, to step]
        self.scale = float(state.get("scale", 1.0))  # product of spike.lr_factor so far

    @property
    def enabled(self) -> bool:
        return self.cfg.zscore > 0

    def check(self, step: int, loss: float) -> float | None:
        if not self.enabled or not math.isfinite(loss):
            return None
        if len(self.recent) >= self.cfg.window:
            values = [v for _, v in self.recent]
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
            z = (loss - mean) / max(std, 1e-7 * abs(mean), 1e-12)
            if z > self.cfg.zscore:
                return z
        self.recent = (self.recent + [(int(step), float(loss))])[-self.cfg.window:]
        return None

    def rolled_back(self, spike_step: int, to_step: int) -> None:
        self.recent = [(s, v) for s, v in self.recent if s <= to_step]
        self.rollbacks.append([int(spike_step), int(to_step)])
        self.scale *= self.cfg.lr_factor

    def to_json(self) -> dict:
        return {"recent": self.recent, "rollbacks": self.rollbacks, "scale": self.scale}


def agree(stop: int, factor: float | None, checkpoint: bool = False
          ) -> tuple[int, float | None, bool]:
    """Process 0's decision on every process (one small broadcast per eval): `stop` is 0
    or the stopping rule's position + 1, `factor` the new learning-rate factor or None,
    `checkpoint` whether a rule asked to save the step."""
    import jax

    if jax.process_count() == 1:
        return stop, factor, checkpoint
    import numpy as np
    from jax.experimental import multihost_utils

    code = np.asarray([float(stop), -1.0 if factor is None else float(factor),
                       float(checkpoint)], np.float64)
    code = np.asarray(multihost_utils.broadcast_one_to_all(code))
    return int(code[0]), (None if code[1] < 0 else float(code[1])), bool(code[2])
