"""A population: K variants of one run (seeds, learning rates) trained as one jitted
program. The TrainState gets a leading member axis [K, ...]; `jax.vmap` runs the pure
init and train step over it, so one compile trains every member on the same batches.

- Member i's init and dropout seed is `population.seeds[i]` (default seed + i); its
  learning rate enters as the state's `lr_factor` (= its lr / optim.lr), which the step
  already multiplies into the update, so varying it needs no recompile. Its
  `optim.weight_decay` (when population.vary has it) is a rate in its optimizer state
  (jtrain.optim.decay), set at init.
- Metrics: the step's per-member values are written as `train/<name>/m<i>`; the plain
  `train/<name>` is the mean over members (what the progress line, the loss window and
  the skip checks read; `train/status` is the OR of the members' bits).
- The member axis is sharded over the mesh's `data` axis when K is a multiple of its
  size and the parameters do not use that axis; otherwise it is replicated.
- `member(state, i)`: one member's TrainState (eval, export); `per_member`: an evaluation
  of each, combined; `report`: summary.json's population block and population.png.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jtrain import state as state_lib
from jtrain.config import schema_population
from jtrain.errors import ConfigError
from jtrain.observe import jsonl, plots
from jtrain.optim import decay as optim_decay


@dataclasses.dataclass(frozen=True)
class Population:
    size: int
    seeds: tuple[int, ...]
    lrs: tuple[float, ...]  # each member's optim.lr
    base_lr: float  # optim.lr: the schedule's peak; lr_factor = lr / base_lr
    sharded: bool = False  # the member axis over the mesh's data axis
    weight_decays: tuple[float, ...] | None = None  # each member's; None = not varied

    @property
    def lr_factors(self) -> np.ndarray:
        return np.asarray([lr / self.base_lr for lr in self.lrs], np.float32)

    def describe(self) -> str:
        """The header's line."""
        lrs = ("" if len(set(self.lrs)) == 1
               else ", lr " + " ".join(f"{lr:g}" for lr in self.lrs))
        if self.weight_decays is not None:
            lrs += ", weight_decay " + " ".join(f"{v:g}" for v in self.weight_decays)
        where = ("sharded over the data axis" if self.sharded
                 else "replicated on every device")
        return (f"jtrain: population: {self.size} members in one compiled step (seeds "
                f"{' '.join(map(str, self.seeds))}{lrs}); member axis {where}; shared "
                "batches")


def from_config(cfg) -> Population | None:
    """The run's population, or None when population.size is 1 (a plain run)."""
    size = int(cfg.population.size)
    if size == 1:
        return None
    vary = schema_population.flat_vary(cfg.population.vary)
    base = float(cfg.optim.lr)
    lrs = tuple(float(v) for v in vary.get("optim.lr", (base,) * size))
    wds = vary.get("optim.weight_decay")
    return Population(size=size, seeds=schema_population.member_seeds(cfg), lrs=lrs,
                      base_lr=base,
                      weight_decays=None if wds is None else tuple(float(v) for v in wds))


def decay_in_state(cfg) -> bool:
    """Whether the optimizer keeps its weight decay rate in the state (per member)."""
    return int(cfg.population.size) > 1 and "optim.weight_decay" in \
        schema_population.flat_vary(cfg.population.vary)


def with_mesh(pop: Population, mesh, shardings) -> Population:
    """Decides whether the member axis is sharded over the data axis (see module doc)."""
    data = int(mesh.shape.get("data", 1))
    uses_data = any("data" in _names(s.spec) for s in jax.tree.leaves(shardings)
                    if isinstance(s, NamedSharding))
    return dataclasses.replace(pop, sharded=data > 1 and pop.size % data == 0
                               and not uses_data)


def _names(spec) -> set:
    out = set()
    for part in spec:
        out.update(part if isinstance(part, tuple) else (part,))
    return out


def _per_member(fn, state):
    """`fn` on every field but `step` (the members share it: one int32 [])."""
    return jax.tree.map(fn, state.replace(step=None)).replace(step=state.step)


def axes(state):
    """vmap's axes of a population state: 0 for every leaf, None (shared) for `step`."""
    return jax.tree.map(lambda _: 0, state.replace(step=None)).replace(step=None)


def abstract(pop: Population, member_abstract):
    """The population's abstract state: a leading [K] axis on every leaf but `step`."""
    return _per_member(lambda a: jax.ShapeDtypeStruct((pop.size, *a.shape), a.dtype),
                       member_abstract)


def shardings(pop: Population, member_shardings):
    """The members' shardings with the member axis in front (sharded or replicated)."""
    lead = "data" if pop.sharded else None
    return _per_member(lambda s: NamedSharding(s.mesh, P(lead, *s.spec)), member_shardings)


def init(pop: Population, model_fns, tx, policy, sample_inputs, mesh, out_shardings, *,
         ema: bool):
    """Every member's fresh state, built in its shardings by one jitted vmap: member i is
    `jtrain.state.init_state` with seed `pop.seeds[i]`, its lr factor (and weight decay
    rate) set."""
    if model_fns.existing_params is not None:
        raise ConfigError("population.size", "an NNX model instance holds one set of "
                          "parameters; pass its class or a function building it so each "
                          "member initialises from its own seed")
    inputs = jax.tree.map(lambda s: jnp.zeros((1,) + tuple(s.shape[1:]), s.dtype),
                          sample_inputs)

    def create(seed, factor, wd):
        rng = jax.random.key(seed)
        key = jax.random.fold_in(rng, 0)
        params = nn.unbox(model_fns.init(key, inputs))
        model_state = state_lib._no_empty(model_fns.state_init(key, inputs))
        state = state_lib._fresh_state(params, tx, policy, rng, ema, model_state)
        if pop.weight_decays is not None:
            state = state.replace(opt_state=optim_decay.set_rate(state.opt_state, wd))
        return state.replace(lr_factor=factor)

    state_axes = axes(out_shardings)
    with jax.set_mesh(mesh):
        return jax.jit(jax.vmap(create, out_axes=state_axes), out_shardings=out_shardings)(
            jnp.asarray(pop.seeds, jnp.uint32), jnp.asarray(pop.lr_factors),
            jnp.asarray(pop.weight_decays or (0.0,) * pop.size, jnp.float32))


# Per-step values that are not written (jtrain.engine.loop reads them reduced).
_HOST_ONLY = ("train/status", "train/rows_ok", "train/consecutive_skips")


def train_step(pop: Population, member_step: Callable) -> Callable:
    """`member_step(state, batch) -> (state, metrics)` over the member axis (the batch
    shared), with the metrics reduced for the loop and each member's as `<name>/m<i>`."""
    def step(state, batch):
        state_axes = axes(state)
        new_state, metrics = jax.vmap(member_step, in_axes=(state_axes, None),
                                      out_axes=(state_axes, 0))(state, batch)
        return new_state, reduce_metrics(metrics, pop.size)

    return step


def reduce_metrics(metrics: dict, size: int) -> dict:
    """Stacked [K] metrics -> the loop's view: the mean over members under each plain
    name (tokens: member 0's, the batch is shared), `train/status` the OR of every
    member's bits, the skip counters their maximum, `train/rows_ok` all members' rows;
    plus `<name>/m<i>` per member for every written value."""
    out = {}
    for name, value in metrics.items():
        if name == "train/status":
            out[name] = functools.reduce(jnp.bitwise_or, [value[i] for i in range(size)])
        elif name in ("train/skipped_steps", "train/consecutive_skips"):
            out[name] = value.max(axis=0)
        elif name == "train/rows_ok":
            out[name] = value.all(axis=0)
        elif name == "train/tokens":
            out[name] = value[0]
        else:
            out[name] = value.mean(axis=0)
        if name not in _HOST_ONLY and name != "train/tokens":
            for i in range(size):
                out[member_name(name, i)] = value[i]
    return out


def member_name(name: str, i: int) -> str:
    """`train/loss` of member 3 -> `train/loss/m3`."""
    return f"{name}/m{i}"


def member(state: Any, i: int):
    """Member i's TrainState."""
    return _per_member(lambda x: x[i], state)


def per_member(pop: Population, state, evaluate: Callable):
    """`evaluate(one member's state) -> Evaluation` (engine.evaluation) of every member,
    as one Evaluation whose scalars are `combine`d (member 0's arrays)."""
    results = [evaluate(member(state, i)) for i in range(pop.size)]
    return dataclasses.replace(results[0], scalars=combine([r.scalars for r in results]))


def combine(per_member: list[dict]) -> dict:
    """Member evals {name: value} -> one record: each name's mean over members, each
    member's value as `<name>/m<i>` (non-numbers: member 0's)."""
    out: dict = {}
    for name in per_member[0]:
        values = [m.get(name) for m in per_member]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[name] = float(np.mean(values))
            out.update({member_name(name, i): float(v) for i, v in enumerate(values)})
        else:
            out[name] = values[0]
    return out


_LOWER_IS_BETTER = ("loss", "mse", "mae", "perplexity", "bits_per_byte", "grad_norm")


def winners(records: list[dict], size: int) -> dict[str, int]:
    """{metric: the member whose last logged value is best} for every metric logged per
    member in `records` (metrics.jsonl), by summary_block's rule; `train/lr` (a setting,
    not an outcome) has none."""
    last: dict[str, dict[int, float]] = {}
    for record in records:
        for key, value in record.items():
            name, _, i = key.rpartition("/m")
            if name and i.isdigit() and int(i) < size and isinstance(value, (int, float)):
                last.setdefault(name, {})[int(i)] = float(value)
    out = {}
    for name, values in last.items():
        if name == "train/lr" or len(values) != size:
            continue
        arr = np.asarray([values[i] for i in range(size)], np.float64)
        lower = any(part in name for part in _LOWER_IS_BETTER)
        out[name] = int(np.nanargmin(arr) if lower else np.nanargmax(arr))
    return out


def summary_block(pop: Population, state, final_eval: dict, *, monitor: str,
                  mode: str) -> dict:
    """summary.json's `population`: the members' seeds and lrs, per metric of the final
    eval the mean, spread (std), min, max and the winning member (lower is better for
    losses and errors, higher for the rest), and `best_member` by checkpoint.monitor."""
    metrics = {}
    for name, value in final_eval.items():
        values = [final_eval.get(member_name(name, i)) for i in range(pop.size)]
        if not isinstance(value, float) or any(v is None for v in values):
            continue
        arr = np.asarray(values, np.float64)
        lower = any(part in name for part in _LOWER_IS_BETTER)
        metrics[name] = {"mean": float(arr.mean()), "std": float(arr.std()),
                         "min": float(arr.min()), "max": float(arr.max()),
                         "best_member": int(np.nanargmin(arr) if lower
                                            else np.nanargmax(arr))}
    best = None
    if monitor in metrics:
        arr = np.asarray([final_eval[member_name(monitor, i)] for i in range(pop.size)])
        best = int(np.nanargmin(arr) if mode == "min" else np.nanargmax(arr))
    return {"size": pop.size, "seeds": list(pop.seeds), "lrs": list(pop.lrs),
            **({} if pop.weight_decays is None
               else {"weight_decays": list(pop.weight_decays)}),
            "sharded": pop.sharded, "best_member": best, "monitor": monitor,
            "skipped_steps": [int(v) for v in np.asarray(jax.device_get(
                state.skipped_steps))],
            "metrics": metrics}


def report(pop: Population, cfg, run, state, session, final_eval: dict) -> dict:
    """summary.json's `population` block (`summary_block`) and, on process 0,
    population.png: every member's curves, their mean and the winner per metric, from
    metrics.jsonl (or this session's records when the jsonl writer is off). `run`: a
    jtrain.engine.loop.Run, `session` the loop's record of this session."""
    if jax.process_index() == 0:
        run.out.writer.flush()  # the last log step and eval in metrics.jsonl
        path = os.path.join(run.workdir, "metrics.jsonl")
        records = (jsonl.read_records(path) if os.path.exists(path)
                   else [*session.train_history, *session.history])
        plots.population_curves(records, os.path.join(run.workdir, "population.png"),
                                pop.size, winners(records, pop.size))
    return {"population": summary_block(pop, state, final_eval,
                                        monitor=cfg.checkpoint.monitor, mode=cfg.checkpoint.mode)}
