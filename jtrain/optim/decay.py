"""Decoupled weight decay whose rate lives in the optimizer state, so a population's
members can each have their own `optim.weight_decay` in one compiled step
(population.vary; jtrain.engine.population sets each member's rate at init).

`optimizer(name, cfg, schedule, wd, mask)` builds adamw, lion or sgd as optax builds
them, with optax's `add_decayed_weights(wd, mask)` replaced by `decay_from_state`:
`g + rate * p` on the masked leaves, `rate` a float32 [] in the state (cast to the
parameter's dtype, as the Python float is in optax's). Member i's update is therefore
the single run's with weight_decay = its rate, term for term. Other optimizers fold the
decay into their own update (adafactor, muon, prodigy) and are refused by the
population's rules (jtrain.config.schema_population)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

# Optimizers whose weight decay is optax's add_decayed_weights in a chain.
NAMES = ("adamw", "lion", "sgd")


class DecayRate(NamedTuple):
    rate: jax.Array  # float32 [], this run's (member's) optim.weight_decay


def decay_from_state(wd: float, mask) -> optax.GradientTransformation:
    """optax.add_decayed_weights with the rate read from the state (init: `wd`)."""

    def init(params):
        del params
        return DecayRate(rate=jnp.asarray(wd, jnp.float32))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError(optax.NO_PARAMS_MSG)
        return jax.tree.map(lambda g, p: g + state.rate.astype(p.dtype) * p,
                            updates, params), state

    return optax.masked(optax.GradientTransformation(init, update), mask)


def optimizer(name: str, cfg, schedule, wd: float, mask) -> optax.GradientTransformation:
    """`name` (one of NAMES) with its weight decay from the state (see module doc)."""
    decay = decay_from_state(wd, mask)
    if name == "adamw":
        return optax.chain(optax.scale_by_adam(b1=cfg["b1"], b2=cfg["b2"], eps=cfg["eps"]),
                           decay, optax.scale_by_learning_rate(schedule))
    if name == "lion":
        return optax.chain(optax.scale_by_lion(b1=cfg["b1"], b2=cfg["b2"]), decay,
                           optax.scale_by_learning_rate(schedule))
    if name == "sgd":
        return optax.chain(decay, optax.sgd(
            schedule, momentum=float(cfg["kwargs"]["momentum"]) or None,
            nesterov=bool(cfg["kwargs"]["nesterov"])))
    raise ValueError(f"no per-member weight decay for optimizer {name!r}")


def set_rate(opt_state, rate):
    """`opt_state` with every DecayRate's rate set to `rate` (a float32 [])."""
    return jax.tree.map(
        lambda s: DecayRate(rate=jnp.asarray(rate, jnp.float32))
        if isinstance(s, DecayRate) else s,
        opt_state, is_leaf=lambda s: isinstance(s, DecayRate))
