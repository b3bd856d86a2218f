"""Learning-rate schedules (`optim.schedule`): the learning rate as a function of the
number of updates applied so far. What each schedule means (warmup prepended, decays end
at `decay_steps`, rsqrt) is described in jtrain.optim, their one reader.
"""

import jax.numpy as jnp
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
