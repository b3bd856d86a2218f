"""The run-control rule protocol: what every rule the loop consults implements, the
built-in ones (early stopping, plateau, spikes, divergence) and a user's callbacks alike.

A rule has three hooks, each returning an `Action` (or None: nothing to do):

- `after_step(step, metrics)`: each step, when the loop reads it back; `metrics` holds
  the step's `train/loss` and `train/status` (the values the loop fetches anyway);
- `after_log(step, scalars)`: at log steps, with every train scalar written there;
- `after_eval(step, eval_metrics)`: after each evaluation (globally reduced metrics);

and `state() -> JSON` / `restore(state)`: its state goes into every checkpoint's
run-control record (`RunControl.monitors`), so a killed run resumes with the same state.
The base class `Rule` gives no-op hooks and no state; a user's object may also define only
the methods it needs (duck typing). `User` adapts such an object for the loop: its
learning-rate factors multiply into one scale, its scalars get the `callback/` prefix.
`OnEval` adapts `train(on_eval=...)`, the older one-hook form.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from jtrain.errors import ConfigError, NonFiniteError

PREFIX = "callback/"  # a callback's logged scalars in metrics.jsonl


@dataclasses.dataclass
class Action:
    """What a hook asks for. `stop`: stop after this step (the reason, one line; saved
    and recorded as summary.json's stop_reason); `lr_factor`: multiply the learning rate
    by this from the next step on; `log`: scalars to write at this step; `checkpoint`:
    save this step; `warn`: a warning line (console, train.log); `rollback`: the spike
    rule's z-score (roll back to the newest checkpoint before this step)."""
    stop: str | None = None
    lr_factor: float | None = None
    log: dict[str, float] | None = None
    checkpoint: bool = False
    warn: str | None = None
    rollback: float | None = None


class Rule:
    """A run-control rule: override the hooks you need. `name` keys its state in the
    checkpoint's record; `stopped_by` is what summary.json says when it stops the run."""
    name = "rule"
    stopped_by = "callback"
    lr_scale = 1.0  # the learning-rate factor this rule applies now (built-ins: theirs)

    def after_step(self, step: int, metrics: dict) -> Action | None:
        return None

    def after_log(self, step: int, scalars: dict) -> Action | None:
        return None

    def after_eval(self, step: int, eval_metrics: dict) -> Action | None:
        return None

    def state(self) -> Any:
        return None

    def restore(self, state: Any) -> None:
        pass


class User(Rule):
    """A user's callback as the loop sees it: the hooks it defines, called; the product
    of its learning-rate factors kept (and saved) beside its own state."""
    stopped_by = "callback"

    def __init__(self, callback, name: str):
        self.callback, self.name = callback, name
        self.lr_scale = 1.0
        kind = type(callback)
        # A hook it overrides: the loop drains every step that hook sees before it
        # dispatches the next, so what it asks for applies from the next step on in
        # every run, interrupted or not.
        self.per_step = _defines(kind, "after_step")
        self.per_log = _defines(kind, "after_log")

    def _call(self, hook: str, step: int, values: dict) -> Action | None:
        method = getattr(self.callback, hook, None)
        action = method(step, dict(values)) if method is not None else None
        if action is None:
            return None
        if not isinstance(action, Action):
            raise ConfigError("control.callbacks", f"{self.name}.{hook} returned "
                              f"{type(action).__name__}; expected jtrain.control.Action or None")
        if action.lr_factor is not None:
            factor = float(action.lr_factor)
            if not (math.isfinite(factor) and factor > 0):
                raise ConfigError("control.callbacks", f"{self.name}.{hook} at step {step} "
                                  f"asked for learning-rate factor {factor}; it must be "
                                  "finite and > 0")
            self.lr_scale *= factor
        if action.log:
            action = dataclasses.replace(action, log={
                f"{PREFIX}{k}": float(v) for k, v in action.log.items()})
        if action.stop:
            action = dataclasses.replace(action, stop=f"{self.name}: {action.stop}")
        return action

    def after_step(self, step, metrics):
        return self._call("after_step", step, metrics)

    def after_log(self, step, scalars):
        return self._call("after_log", step, scalars)

    def after_eval(self, step, eval_metrics):
        return self._call("after_eval", step, eval_metrics)

    def state(self):
        own = getattr(self.callback, "state", None)
        return {"state": own() if own is not None else None, "lr_scale": self.lr_scale}

    def restore(self, state):
        if not state:
            return
        self.lr_scale = float(state["lr_scale"])
        own = getattr(self.callback, "restore", None)
        if own is not None:
            own(state["state"])


class OnEval(Rule):
    """`train(on_eval=fn)`: `fn(step, metrics) -> bool` on process 0 after each eval,
    not called once another rule stops the run; True stops it."""
    name, stopped_by = "on_eval", "on_eval"
    primary_only = True  # process 0 decides; the loop broadcasts it
    only_if_running = True

    def __init__(self, fn: Callable[[int, dict], bool]):
        self.fn = fn

    def after_eval(self, step, eval_metrics):
        if self.fn(step, dict(eval_metrics)):
            return Action(stop="the on_eval hook asked to stop")
        return None


def users(callbacks, paths=()) -> list[User]:
    """The user's callbacks, `train(callbacks=...)` first, then `control.callbacks`
    (import paths of a class or a function returning the callback, called with no
    arguments), each with its record key (its class name, numbered when repeated)."""
    from jtrain.config.named import load_named

    objs = list(callbacks or ())
    for i, path in enumerate(paths):
        key = f"control.callbacks.{i}"
        factory = load_named(path, key, ConfigError)
        try:
            objs.append(factory() if callable(factory) else factory)
        except Exception as e:  # noqa: BLE001 - the user's constructor: one line
            raise ConfigError(key, f"{path}() raised {type(e).__name__}: {e}") from None
    out, seen = [], {}
    for obj in objs:
        if not any(hasattr(obj, h) for h in ("after_step", "after_log", "after_eval")):
            raise ConfigError("control.callbacks", f"{type(obj).__name__} has none of "
                              "after_step, after_log, after_eval")
        base = type(obj).__name__
        seen[base] = seen.get(base, 0) + 1
        out.append(User(obj, base if seen[base] == 1 else f"{base}#{seen[base]}"))
    return out


def halt(message: str, step: int) -> NonFiniteError:
    """The halt error, carrying its step (summary.json records it)."""
    error = NonFiniteError(message)
    error.step = step
    return error


def _defines(kind: type, hook: str) -> bool:
    own = getattr(kind, hook, None)
    return own is not None and own is not getattr(Rule, hook)
