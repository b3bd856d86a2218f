"""Learning-rate schedules (`optim.schedule`): the learning rate as a function of the
number of updates applied so far. What each schedule means (warmup prepended, decays end
at `decay_steps`, rsqrt) is described in jtrain.optim, their one reader.
"""

import jax.numpy as jnp
import numpy as np
import optax

from jtrain.errors import ConfigError


# Schedules. Each builder returns the schedule *after* the warmup, as a function of
# the steps since the warmup ended; `make_schedule` prepends the warmup.
def _constant(lr, end_lr, warmup, decay_steps):
    del end_lr, warmup, decay_steps
    return optax.constant_schedule(lr)


def _linear(lr, end_lr, warmup, decay_steps):
    return optax.linear_schedule(lr, end_lr, decay_steps - warmup)


def _cosine(lr, end_lr, warmup, decay_steps):
    # optax's alpha is the final value as a fraction of the initial one.
    alpha = end_lr / lr if lr else 0.0
    return optax.cosine_decay_schedule(lr, decay_steps - warmup, alpha=alpha)


def _rsqrt(lr, end_lr, warmup, decay_steps):
    del end_lr, decay_steps
    scale = max(warmup, 1)

    def schedule(count):
        step = jnp.maximum(jnp.asarray(count, jnp.float32) + warmup, 1.0)
        return lr * jnp.sqrt(scale / step)

    return schedule


_SCHEDULES = {
    "constant": (_constant, False),  # (builder, decays to decay_steps)
    "linear": (_linear, True),
    "cosine": (_cosine, True),
    "warmup_cosine": (_cosine, True),
    "warmup_linear": (_linear, True),
    "rsqrt": (_rsqrt, False),
}
SCHEDULES = tuple(_SCHEDULES)


def make_schedule(optim_cfg, total_steps):
    """The learning rate as a function of the number of updates applied so far."""
    name = optim_cfg["schedule"]
    if name not in _SCHEDULES:
        raise ConfigError("optim.schedule",
                          f"unknown schedule {name!r}; choose one of: {', '.join(SCHEDULES)}")
    builder, decays = _SCHEDULES[name]
    lr = float(optim_cfg["lr"])
    end_lr = lr * float(optim_cfg["end_lr_factor"])
    warmup = int(optim_cfg["warmup_steps"])
    decay_steps = int(optim_cfg["decay_steps"]) or int(total_steps)
    if decays and decay_steps <= warmup:
        raise ConfigError(
            "optim.decay_steps", f"schedule {name!r} decays until step {decay_steps} "
            f"(0 means total_steps={total_steps}), which must be > optim.warmup_steps={warmup}")
    after_warmup = builder(lr, end_lr, warmup, decay_steps)
    if warmup <= 0:
        return after_warmup
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), after_warmup], [warmup])


def horizon(optim_cfg, total_steps) -> tuple[int, int | None]:
    """(warmup end, decay end) in steps; decay end None for schedules that ignore it."""
    decays = _SCHEDULES.get(optim_cfg["schedule"], (None, False))[1]
    decay_end = int(optim_cfg["decay_steps"]) or int(total_steps)
    return int(optim_cfg["warmup_steps"]), decay_end if decays else None


def _horizon_keys(cfg: dict) -> dict:
    optim = cfg["optim"]
    return {"total_steps": cfg["total_steps"], "optim.warmup_steps": optim["warmup_steps"],
            "optim.decay_steps": optim["decay_steps"]}


def replan_line(saved: dict, current: dict, step: int) -> str | None:
    """The line a resume at `step` prints when its config moves the schedule's horizon
    (`saved`: the checkpoint's config, `current`: this run's, both resolved dicts): the
    lr of the next update under each plan, and the keys that keep the saved plan. None
    when the horizon did not move. Raising total_steps re-plans a decay that ends at
    total_steps, and the learning rate jumps back up: only the header's "decay until
    step" would show it otherwise."""
    old_keys, new_keys = _horizon_keys(saved), _horizon_keys(current)
    moved = [k for k in old_keys if old_keys[k] != new_keys[k]]
    (w0, d0), (w1, d1) = (horizon(saved["optim"], saved["total_steps"]),
                          horizon(current["optim"], current["total_steps"]))
    if not moved or (w0, d0) == (w1, d1):
        return None
    # As the step logs train/lr: float32, at the number of updates applied so far.
    before, after = (float(np.float32(make_schedule(c["optim"], c["total_steps"])(step)))
                     for c in (saved, current))
    if before == after:
        lr = f"lr at step {step} stays {before:.1e}" + (
            f", the decay now ends at step {d1}, not {d0}" if d0 != d1 else "")
    else:
        a, b = f"{before:.1e}", f"{after:.1e}"
        if a == b:  # apart below the digits shown: show enough of them to tell
            a, b = f"{before:.6e}", f"{after:.6e}"
        lr = f"lr at step {step} goes from {a} to {b}"
    keep = ([f"optim.decay_steps={d0}"] if d0 is not None and d0 != d1 else []) + (
        [f"optim.warmup_steps={w0}"] if w0 != w1 else [])
    what = "schedule" if len(keep) != 1 else keep[0].split(".")[1].split("_")[0]
    changed = ", ".join(f"{k} {old_keys[k]} -> {new_keys[k]}" for k in moved)
    return (f"jtrain: {changed} re-plans the schedule: {lr}"
            + (f" (set {', '.join(keep)} to keep the original {what})" if keep else ""))
