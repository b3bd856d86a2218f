"""The weight EMA (`optim.ema`): an exponential moving average of the parameters.

The average lives in `TrainState.ema`, beside the params and sharded like them; it is
None when `optim.ema.decay` is 0, so a run without it has the state, checkpoints and
`state_sha256` it always had. The train step moves it right after each applied update
(`jtrain.step`), inside the guard: a skipped update leaves it untouched.

    ema <- ema + (1 - d) * (params - ema)        # = d * ema + (1 - d) * params

written as a step towards the params so a leaf that does not move (`optim.frozen`)
keeps an average exactly equal to itself. `d` is `optim.ema.decay`, or with
`optim.ema.warmup = "standard"` `min(decay, (1 + t) / (10 + t))`, t the number of
updates applied before this one (TensorFlow's `ExponentialMovingAverage(num_updates)`
and Keras 3's `use_ema` form): the early average follows the params closely instead of
remembering the initialisation. The average starts as a copy of the initial params.

Floating leaves are averaged in float32 whatever the params' dtype (a bfloat16 average at
decay 0.999 would stop moving: its steps round to zero); `as_params` casts it back to
the params' dtypes for evaluation and export.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

WARMUPS = ("none", "standard")


def decay_of(optim_cfg) -> tuple[float, str]:
    """(decay, warmup) of the `optim` section; decay 0 = no EMA."""
    ema = optim_cfg["ema"]
    return float(ema["decay"]), str(ema["warmup"])


def rate_fn(decay: float, warmup: str = "none") -> Callable | None:
    """`rate(t) -> d`: the decay of the update after t applied updates (t: int32 []);
    None when decay is 0 (no EMA)."""
    if not decay:
        return None
    if warmup == "none":
        return lambda t: jnp.asarray(decay, jnp.float32)
    if warmup == "standard":
        def rate(t):
            t = jnp.asarray(t, jnp.float32)
            return jnp.minimum(jnp.float32(decay), (1.0 + t) / (10.0 + t))
        return rate
    raise ValueError(f"optim.ema.warmup: unknown {warmup!r}; choose one of: "
                     f"{', '.join(WARMUPS)}")


def _average_dtype(dtype):
    return jnp.float32 if jnp.issubdtype(dtype, jnp.floating) else dtype


def init(params):
    """The average at step 0: a copy of the params (floating leaves in float32)."""
    return jax.tree.map(lambda p: jnp.array(p, dtype=_average_dtype(p.dtype), copy=True),
                        params)


def update(ema, params, rate):
    """One step of the average towards `params` with decay `rate` (a float32 scalar)."""
    def one(e, p):
        if not jnp.issubdtype(e.dtype, jnp.floating):
            return p.astype(e.dtype)
        return e + (1.0 - rate).astype(e.dtype) * (p.astype(e.dtype) - e)
    return jax.tree.map(one, ema, params)


def as_params(ema, params):
    """The average in the params' dtypes (what an eval step or an export takes)."""
    return jax.tree.map(lambda e, p: e if e.dtype == p.dtype else e.astype(p.dtype),
                        ema, params)


def bytes_per_device(abstract_ema, shardings) -> int:
    """The average's memory on one device: its shards' bytes (the header says it)."""
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(abstract_ema), jax.tree.leaves(shardings)):
        shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        total += int(np.prod(shape)) * np.dtype(leaf.dtype).itemsize
    return total
