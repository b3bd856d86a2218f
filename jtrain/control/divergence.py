"""The divergence warning (`log.divergence_warning`): one warning line, once per run,
when a logged train loss window (`train/loss_window`, the mean over the steps since the
last log step) is more than `factor` times the run's first logged window. It reads the
values the loop already holds on the host at log steps (no extra device sync) and
changes nothing in training; the line goes to the console and train.log and into
summary.json's `warnings`. Its state (the first window, whether it warned) is JSON in
the checkpoint's run-control record, so a resumed run compares against the same start
and does not warn twice.
"""

from __future__ import annotations

import math

from jtrain.control.rule import Action, Rule


class Divergence(Rule):
    """`check(step, loss_window)` -> the warning line the first time the loss window is
    above `factor` x the first one (a positive, finite first window), else None."""
    name = "divergence"

    def __init__(self, factor: float, state: dict | None = None):
        self.factor = float(factor)
        self.restore(state)

    @classmethod
    def from_config(cls, cfg) -> "Divergence":
        return cls(cfg.log.get("divergence_warning", 0.0))

    def after_log(self, step, scalars):
        line = self.check(step, scalars["train/loss_window"])
        return Action(warn=line) if line else None

    def state(self) -> dict:
        return self.to_json()

    def restore(self, state: dict | None) -> None:
        state = state or {}
        first = state.get("first")
        self.first: tuple[int, float] | None = (int(first[0]), float(first[1])) \
            if first else None
        self.warnings: list[str] = list(state.get("warnings", []))

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    def check(self, step: int, loss_window: float) -> str | None:
        if not self.enabled or not math.isfinite(loss_window):
            return None
        if self.first is None:
            self.first = (int(step), float(loss_window))
            return None
        first_step, first = self.first
        if self.warnings or first <= 0 or loss_window <= self.factor * first:
            return None
        line = (f"jtrain: warning: step {step}: the train loss ({loss_window:.4g}, mean of "
                f"the log window) is {loss_window / first:.3g}x its first logged value "
                f"({first:.4g} at step {first_step}): training is diverging; lower "
                f"optim.lr or set optim.clip_norm (warned once; log.divergence_warning="
                f"{self.factor:g}, 0 = off)")
        self.warnings.append(line)
        return line

    def to_json(self) -> dict:
        return {"first": list(self.first) if self.first else None,
                "warnings": self.warnings}
