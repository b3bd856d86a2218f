"""The loop's host-side decisions, in one object: what to do after each step the loop
drains (a skipped update: a warning and a ledger entry; a halt: `NonFiniteError`) and
what the run-control rules (jtrain.control.rule) ask after each step, log step and
evaluation: the built-in ones (`BUILT_IN`, in this order), the `on_eval` hook, then the
user's callbacks.

Everything it decides from comes from global values (the step's in-graph status, the
globally reduced eval metrics) and its state goes into every checkpoint
(`state()` -> `RunControl.monitors`, `ledger.entries` -> `RunControl.skip_ledger`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Callable

from jtrain import step as step_lib
from jtrain.control import ledger as ledger_lib
from jtrain.control import divergence as divergence_lib, monitors, rule as rule_lib
from jtrain.errors import ConfigError

# The built-in rules, in the order they are consulted (each: a Rule with
# `from_config(cfg)`; its `name` keys its state in the checkpoint's record). A new rule
# is its module and one entry here.
BUILT_IN = (monitors.EarlyStopping, monitors.Plateau, monitors.Spike,
            divergence_lib.Divergence)


@dataclasses.dataclass
class AfterEval:
    stop: str | None = None  # the reason, one line
    stopped_by: str | None = None  # "early_stop" | "on_eval" | "callback"
    factor: float | None = None  # the new learning-rate factor of the state
    lr_by: str | None = None  # the rule that changed it
    checkpoint: bool = False  # a rule asked to save this step
    log: dict = dataclasses.field(default_factory=dict)  # callback/* scalars


@dataclasses.dataclass
class Pending:
    """What the hooks of drained steps asked for, until the loop applies it."""
    stop: str | None = None
    stopped_by: str | None = None
    lr_by: str | None = None  # a rule changed the learning-rate factor
    checkpoint: bool = False


class Decisions:
    def __init__(self, cfg, record, *, ledger: ledger_lib.Ledger, on_eval: Callable | None,
                 batch_of: Callable[[int], int | None], indices_of: Callable,
                 say: Callable[[str], None], callbacks=()):
        self.cfg, self.ledger, self.say = cfg, ledger, say
        self.batch_of, self.indices_of = batch_of, indices_of
        saved = dict(record.monitors or {})
        self.rules: list[rule_lib.Rule] = [kind.from_config(cfg) for kind in BUILT_IN]
        if on_eval is not None:
            self.rules.append(rule_lib.OnEval(on_eval))
        self.users = list(callbacks)
        self.rules += self.users
        for r in self.rules[:len(BUILT_IN)]:
            r.restore(saved.get(r.name))
        for u in self.users:
            u.restore(saved.get("callbacks", {}).get(u.name))
        self.early, self.plateau, self.spike, self.divergence = self.rules[:4]
        self.pending = Pending()
        self.halted: str | None = None

    # -- after a step ---------------------------------------------------------------------
    def syncs(self, step: int) -> bool:
        """Whether the loop drains `step` before it dispatches the next: a callback's
        after_step (or after_log at a log step) sees it, and what it asks for applies
        from the next step on, killed and resumed or not."""
        log = step % self.cfg.log.every_steps == 0 or step == self.cfg.total_steps
        return any(u.per_step or (log and u.per_log) for u in self.users)

    def after_step(self, step: int, status: int, loss: float) -> rule_lib.Action:
        """The rules' after_step hooks; the merged action (its `rollback`: the spike's
        z-score; its `log`: scalars to write at `step`)."""
        return self._hooks("after_step", step, {"train/loss": loss, "train/status": status})

    def after_log(self, step: int, scalars: dict) -> dict:
        """The rules' after_log hooks at a log step: their warnings said; the scalars
        they log (callback/*), to write with the step's."""
        return self._hooks("after_log", step, scalars).log or {}

    def _hooks(self, hook: str, step: int, values: dict) -> rule_lib.Action:
        merged = rule_lib.Action(log={})
        for r in self.rules:
            action = getattr(r, hook)(step, values)
            if action is None:
                continue
            if action.warn:
                self.say(action.warn)
            if action.rollback is not None and merged.rollback is None:
                merged.rollback = action.rollback
            merged.log.update(action.log or {})
            self._note(r, action)
        return merged

    def _note(self, r: rule_lib.Rule, action: rule_lib.Action) -> None:
        p = self.pending
        if action.stop and not p.stop:
            p.stop, p.stopped_by = action.stop, r.stopped_by
        if action.lr_factor is not None:
            p.lr_by = r.name
        p.checkpoint = p.checkpoint or action.checkpoint

    def take(self) -> Pending:
        """What the drained steps' hooks asked for since the last call."""
        out, self.pending = self.pending, Pending()
        return out

    def nonfinite(self, step: int, status: int, skipped_total: int, consecutive: int,
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
            raise rule_lib.halt(self.halted, step)
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
            raise rule_lib.halt(self.halted, step)

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

    def lr_factor(self) -> float:
        """The learning-rate factor the state should carry: every rule's, multiplied in
        the rules' order (plateau x spike x the callbacks')."""
        return math.prod(r.lr_scale for r in self.rules)

    # -- after an evaluation ----------------------------------------------------------------
    def after_eval(self, step: int, metrics: dict, *, primary: bool) -> AfterEval:
        out, stopper, changed = AfterEval(), 0, None
        for i, r in enumerate(self.rules):
            if (getattr(r, "primary_only", False) and not primary) or (
                    getattr(r, "only_if_running", False) and stopper):
                continue
            try:
                action = r.after_eval(step, metrics)
            except KeyError as e:  # checked at start-up; a metric can still vanish
                if i >= len(BUILT_IN):
                    raise
                raise ConfigError("early_stop.monitor", str(e.args[0])) from None
            if action is None:
                continue
            if action.stop and not stopper:
                stopper, out.stop, out.stopped_by = i + 1, action.stop, r.stopped_by
            if action.lr_factor is not None:
                changed = changed or r.name
            out.checkpoint = out.checkpoint or action.checkpoint
            out.log.update(action.log or {})
        stop, factor, out.checkpoint = monitors.agree(
            stopper, self.lr_factor() if changed else None, out.checkpoint)
        if stop and not out.stop:  # process 0 decided; say the same here
            out.stopped_by = self.rules[stop - 1].stopped_by
            out.stop = f"process 0 decided to stop ({out.stopped_by})"
        out.factor, out.lr_by = factor, changed or (self.plateau.name if factor else None)
        return out

    def state(self) -> dict:
        out = {r.name: r.state() for r in self.rules[:len(BUILT_IN)]}
        if self.users:
            out["callbacks"] = {u.name: u.state() for u in self.users}
        return out

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
