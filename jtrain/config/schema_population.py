"""The schema's `population` section (K variants of one run trained as one jitted program,
jtrain.engine.population) and its rules: which keys may vary, the members' seeds and learning
rates, the run-control features a population does not support. jtrain.config.schema
places the section after the run-control ones."""

from __future__ import annotations

from typing import Any

from jtrain.config.fields import F, INT_MAX, SCHEDULE_FREE
from jtrain.errors import ConfigError

POPULATION_SECTIONS: dict[str, Any] = {
    "population": {  # jtrain/engine/population.py; changes what is trained: not resume-safe
        "size": F(int, 1, (1, 1024), "members trained together in one compiled step "
                  "(vmap over the state); 1 = off, a plain run"),
        "seeds": F("ints", (), (0, INT_MAX), "each member's init and dropout seed; () = "
                   "seed, seed+1, ...; the data order stays the run's seed"),
        "vary": F("dict", {}, None, "{key: [one value per member]}; supported keys: "
                  + ", ".join(("optim.lr", "optim.weight_decay")) + "; e.g. {'optim.lr': [1e-3, "
                  "3e-3]}"),
    },
}

# Keys whose values can differ between members without a recompile: read inside the step.
VARY_KEYS = ("optim.lr", "optim.weight_decay")
# Optimizers whose weight decay can be a per-member rate (jtrain.optim.decay.NAMES).
_DECAY_OPTIMIZERS = ("adamw", "lion", "sgd")
# Settings whose host-side decisions are made for one run, not per member.
_REFUSED = {
    "early_stop.monitor": "early stopping decides for one run, not per member",
    "plateau.monitor": "ReduceLROnPlateau sets one learning-rate factor, not per member",
}


def flat_vary(vary) -> dict[str, tuple]:
    """population.vary with nested sections flattened to dotted keys:
    {"optim": {"lr": [...]}} and {"optim.lr": [...]} both give {"optim.lr": (...)}."""
    out: dict[str, tuple] = {}
    for key, value in dict(vary or {}).items():
        if hasattr(value, "items"):
            out.update({f"{key}.{k}": v for k, v in flat_vary(value).items()})
        else:
            out[str(key)] = value if isinstance(value, tuple) else (
                tuple(value) if isinstance(value, list) else value)
    return out


def check(tree: dict) -> None:
    """The `population` section's rules (a whole config's tree): ConfigError naming the key."""
    pop = tree["population"]
    size = pop["size"]
    seeds = tuple(pop["seeds"])
    if seeds and len(seeds) != size:
        raise ConfigError("population.seeds", f"{len(seeds)} seeds for population.size="
                          f"{size}: give one per member or none (seed, seed+1, ...)")
    vary = flat_vary(pop["vary"])
    for key, values in vary.items():
        name = f"population.vary.{key}"
        if key not in VARY_KEYS:
            raise ConfigError(name, "cannot vary within a population (only values read "
                              f"inside the step can: {', '.join(VARY_KEYS)})")
        if not isinstance(values, (tuple, list)) or len(values) != size:
            raise ConfigError(name, f"give one value per member (population.size={size}), "
                              f"got {values!r}")
        _check_values(name, key, values, tree["optim"])
    rows = [(s, *(vary[k][i] for k in sorted(vary))) for i, s in enumerate(seeds)]
    if len(set(rows)) != len(rows):
        raise ConfigError("population.seeds", f"repeated seeds {list(seeds)}: members with "
                          "the same seed and hyperparameters would be identical")
    if size == 1:
        return
    for key, why in _REFUSED.items():
        section, name = key.split(".")
        if tree[section][name]:
            raise ConfigError(key, f"not supported with population.size={size} ({why}); "
                              "set it to '' or train the members one at a time")
    if tree["spike"]["zscore"] > 0:
        raise ConfigError("spike.zscore", f"not supported with population.size={size} (a "
                          "rollback restores one run's state); set it to 0")
    if tree["optim"]["name"] in SCHEDULE_FREE or tree["optim"]["name"].startswith("optax."):
        raise ConfigError("population.size", f"optim.name={tree['optim']['name']} is not "
                          "supported in a population; use population.size=1 or a built-in "
                          "optim.name")
    if tree["log"]["train_metrics"]:
        raise ConfigError("log.train_metrics", f"not supported with population.size={size}: "
                          "the members' train/loss/m<i> are logged; set it to ()")
    if tree["init"]["path"]:
        raise ConfigError("init.path", "not supported with population.size > 1 "
                          "(an export holds one member); train a single run from it")


def _check_values(name: str, key: str, values, optim: dict) -> None:
    """One varied key's values: numbers in the key's range, for an optimizer that reads
    them inside the step."""
    low, ok = ("> 0", lambda v: v > 0) if key == "optim.lr" else (
        "in [0, 10]", lambda v: 0 <= v <= 10)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v):
            raise ConfigError(name, f"values must be numbers {low}, got {v!r}")
    if key == "optim.lr" and not optim["lr"] > 0:
        raise ConfigError(name, "members scale optim.lr's schedule: set optim.lr > 0")
    if key == "optim.weight_decay" and optim["name"] not in _DECAY_OPTIMIZERS:
        raise ConfigError(name, f"optim.name={optim['name']} cannot vary its weight decay "
                          f"per member; use one of {', '.join(_DECAY_OPTIMIZERS)}")


def member_seeds(cfg) -> tuple[int, ...]:
    """Each member's init and dropout seed (population.seeds, or seed, seed+1, ...)."""
    pop = cfg["population"]
    return tuple(pop["seeds"]) or tuple(int(cfg["seed"]) + i for i in range(pop["size"]))


def member_values(cfg, i: int) -> dict[str, Any]:
    """{dotted key: value} that make member `i` of the population a plain run: its seed
    and the values population.vary gives it."""
    out = {"seed": member_seeds(cfg)[i]}
    for key, values in flat_vary(cfg["population"]["vary"]).items():
        out[key] = values[i]
    return out


def nest_vary(tree: dict) -> dict:
    """A copy of a user config dict whose population.vary is nested (dotted keys split),
    so it fits an ml_collections.ConfigDict."""
    pop = tree.get("population")
    if not isinstance(pop, dict) or not hasattr(pop.get("vary"), "items"):
        return tree
    nested: dict = {}
    for key, values in flat_vary(pop["vary"]).items():
        node = nested
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = list(values) if isinstance(values, tuple) else values
    return {**tree, "population": {**pop, "vary": nested}}
