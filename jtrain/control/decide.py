"""The loop's host-side decisions, in one object: what to do after each step the loop
drains (a skipped update: a warning and a ledger entry; a halt: `NonFiniteError`) and
after each evaluation (early stopping, the plateau factor, the user's `on_eval` hook).

Everything it decides from comes from global values (the step's in-graph status, the
globally reduced eval metrics) and its state goes into every checkpoint
(`state()` -> `RunControl.monitors`, `ledger.entries` -> `RunControl.skip_ledger`).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Callable

from jtrain import step as step_lib
from jtrain.control import ledger as ledger_lib
from jtrain.control import divergence as divergence_lib, monitors
from jtrain.errors import ConfigError, NonFiniteError


@dataclasses.dataclass
class AfterEval:
    stop: str | None = None  # the reason, one line
    stopped_by: str | None = None  # "early_stop" | "on_eval"
    factor: float | None = None  # a new plateau factor


class Decisions:
    def __init__(self, cfg, record, *, ledger: ledger_lib.Ledger, on_eval: Callable | None,
                 batch_of: Callable[[int], int | None], indices_of: Callable,
                 say: Callable[[str], None]):
        self.cfg, self.ledger, self.on_eval, self.say = cfg, ledger, on_eval, say
        self.batch_of, self.indices_of = batch_of, indices_of
        saved = dict(record.monitors or {})
        self.early = monitors.EarlyStopping(cfg.early_stop, saved.get("early_stop"))
        self.plateau = monitors.Plateau(cfg.plateau, cfg.optim.lr, saved.get("plateau"))
        self.spike = monitors.Spike(cfg.spike, saved.get("spike"))
        self.divergence = divergence_lib.Divergence(cfg.log.get("divergence_warning", 0.0),
                                                    saved.get("divergence"))
        self.halted: str | None = None

    # -- after a step ---------------------------------------------------------------------
    def after_step(self, step: int, status: int, skipped_total: int, consecutive: int,
                   rows_ok=None) -> None:
        """`status`: the step's `train/status` bits. Raises NonFiniteError on a halt."""
        bad = status & (step_lib.BAD_LOSS | step_lib.BAD_GRADS | step_lib.INVALID_BATCH)
        if step == 1 and status & step_lib.BAD_LOSS and not status & (
                step_lib.INVALID_BATCH | step_lib.HALTED):
            # finite data, the initial parameters: the loss or the model is broken (with
            # nonfinite.policy=halt the halt's own line below says it)
            self.halted = ("step 1: the loss is NaN or inf on the first batch (finite data, "
                           "the initial parameters, no update applied): the loss function or "
                           "the model's outputs are not finite before any training; check "
                           "loss_fn / loss.fn / loss.terms and the model (e.g. a log of 0, "
                           "a division by 0)")
            raise _halt(self.halted, step)
        if bad:
            why = ledger_lib.reason(status)
            batch = self.batch_of(step)
            entry = ledger_lib.entry(step, status, batch=batch, rows_ok=rows_ok,
                                     indices=self.indices_of(batch))
            self.ledger.add(entry)
            where = (f"examples {_short(entry['examples'])}" if "examples" in entry
                     else f"rows {_short(entry['rows'])}")
            run = (f"{consecutive} in a row, " if why != "invalid batch" else "")
            self.say(f"jtrain: warning: step {step}: {why} ({where}); update skipped "
                     f"({run}{skipped_total} skipped in total; WORKDIR/{ledger_lib.FILE})")
        if status & step_lib.HALTED and self.halted is None:
            nf = self.cfg.nonfinite
            rule = ("nonfinite.policy=halt" if nf.policy == "halt" else
                    f"{consecutive} in a row = nonfinite.max_consecutive")
            self.halted = (f"training halted at step {step}: {ledger_lib.reason(status)} "
                           f"({rule}); no update was applied after it; lower optim.lr, set "
                           "optim.clip_norm, or check the data in WORKDIR/"
                           f"{ledger_lib.FILE}")
            raise _halt(self.halted, step)

    def check_spike(self, step: int, loss: float) -> float | None:
        """The z-score of a spike at `step` (the loop rolls back), else None. Raises
        NonFiniteError when spike.max_rollbacks rollbacks did not help."""
        z = self.spike.check(step, loss)
        if z is not None and len(self.spike.rollbacks) >= self.cfg.spike.max_rollbacks:
            self.halted = (f"training halted at step {step}: the train loss spiked again "
                           f"(loss {loss:.4g}, z-score {z:.3g}) after "
                           f"{len(self.spike.rollbacks)} rollbacks (spike.max_rollbacks); "
                           "lower optim.lr or check the data in WORKDIR/"
                           f"{ledger_lib.FILE}")
            raise _halt(self.halted, step)
        return z

    def rolled_back(self, spike_step: int, z: float, to_step: int, last_step: int) -> None:
        """Steps to_step+1..last_step were undone: one ledger entry each, one line."""
        undone = []
        for step in range(to_step + 1, last_step + 1):
            batch = self.batch_of(step)
            out = {"step": step, "reason": f"rolled back (loss spike at step {spike_step})"}
            if batch is not None:
                out["batch"] = int(batch)
                indices = self.indices_of(batch)
                if indices is not None:
                    out["examples"] = [int(i) for i in indices]
            undone.append(out)
        self.ledger.add(*undone)
        self.spike.rolled_back(spike_step, to_step)
        factor = (f"; learning rate x{self.cfg.spike.lr_factor:.3g} (spike.lr_factor)"
                  if self.cfg.spike.lr_factor != 1 else "")
        self.say(f"jtrain: warning: step {spike_step}: train loss spike (z-score {z:.3g} "
                 f"over the last {self.cfg.spike.window} steps); rolled back to step "
                 f"{to_step}, steps {to_step + 1}..{last_step} undone and their batches "
                 f"skipped (WORKDIR/{ledger_lib.FILE}){factor}")

    def check_divergence(self, step: int, loss_window: float) -> None:
        """At a log step: the divergence warning, once (jtrain.control.divergence)."""
        line = self.divergence.check(step, loss_window)
        if line:
            self.say(line)

    def lr_factor(self) -> float:
        """The learning-rate factor the state should carry: plateau x spike."""
        return self.plateau.factor * self.spike.scale

    # -- after an evaluation ----------------------------------------------------------------
    def after_eval(self, step: int, metrics: dict, *, primary: bool) -> AfterEval:
        out = AfterEval()
        try:
            out.stop = self.early.update(step, metrics)
            out.factor = self.plateau.update(step, metrics)
        except KeyError as e:  # checked at start-up; a metric can still vanish (NaN-only)
            raise ConfigError("early_stop.monitor", str(e.args[0])) from None
        if out.stop:
            out.stopped_by = "early_stop"
        if self.on_eval is not None and not out.stop:
            wants = bool(self.on_eval(step, dict(metrics))) if primary else False
            stop, _ = monitors.agree(wants, None)
            if stop:
                out.stop, out.stopped_by = "the on_eval hook asked to stop", "on_eval"
        stop, factor = monitors.agree(bool(out.stop), out.factor)
        if stop and not out.stop:  # process 0 decided; say the same here
            out.stop, out.stopped_by = "process 0 decided to stop", "early_stop"
        out.factor = None if factor is None else factor * self.spike.scale
        return out

    def state(self) -> dict:
        return {"early_stop": self.early.to_json(), "plateau": self.plateau.to_json(),
                "spike": self.spike.to_json(), "divergence": self.divergence.to_json()}

    def best(self) -> dict:
        """The monitored metric's best step and value, for the summary."""
        for watch in (self.early, self.plateau):  # early_stop first, then plateau
            if watch.enabled and watch.best.step is not None:
                return {"best_metric": watch.cfg.monitor, "best_step": watch.best.step,
                        "best_value": watch.best.value}
        return {}


def check_monitors(cfg, eval_keys: set[str] | None) -> None:
    """ConfigError before the first step for a monitor naming a metric the run will
    never produce. `eval_keys`: the eval metric names, None when there is no eval data."""
    wanted = [(f"{section}.monitor", cfg[section].monitor) for section in
              ("early_stop", "plateau") if cfg[section].monitor]
    if "tune" in cfg and cfg.tune.space:  # a trial of python -m jtrain.tune
        wanted.append(("tune.monitor", cfg.tune.monitor))
    if cfg.checkpoint.keep_top_k and eval_keys is not None:
        wanted.append(("checkpoint.monitor", cfg.checkpoint.monitor))
    for key, name in wanted:
        if eval_keys is None:
            raise ConfigError(key, f"{name!r} needs evaluations, and this run has no eval "
                                   "data (pass eval_data or set data.val_fraction > 0)")
        if name not in eval_keys:
            close = difflib.get_close_matches(name, sorted(eval_keys), n=1)
            hint = f' (did you mean "{close[0]}"?)' if close else ""
            raise ConfigError(key, f"{name!r} is not a metric this run produces{hint}; it "
                                   "has: " + ", ".join(sorted(eval_keys)))
    if (cfg.early_stop.monitor or cfg.plateau.monitor) and not cfg.eval.every_steps:
        key = "early_stop.monitor" if cfg.early_stop.monitor else "plateau.monitor"
        raise ConfigError(key, "needs periodic evaluations: set eval.every_steps > 0")


def _short(xs: list, n: int = 8) -> str:
    head = ", ".join(str(x) for x in xs[:n])
    return f"[{head}{', ...' if len(xs) > n else ''}] ({len(xs)})"


def _halt(message: str, step: int) -> NonFiniteError:
    """The halt error, carrying its step (summary.json records it)."""
    error = NonFiniteError(message)
    error.step = step
    return error
