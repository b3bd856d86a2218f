"""Topology-invariant steps (`determinism.topology_invariant`): the same bits on 1, 2, 4
or 8 devices, in one process or several, and across an elastic resume.

A psum or a reduction over a sharded axis adds partial sums in an order that depends on
how many devices hold the parts, so the same run on 1 and on 8 devices differs in the
last bits. Here every reduction that crosses devices is replaced by a fixed program:

- the global batch is cut into `determinism.chunks` (K) equal chunks of consecutive rows,
  whatever the device count; each device holds K / (data x fsdp) of them and runs the
  same per-chunk program on each, one after the other (`lax.map` inside a `shard_map`
  whose parameters are whole on every device);
- the K chunk results (loss and weight sums, gradients, metric states, the model's
  state) are gathered (an all-gather moves bits, it adds nothing) and summed in the fixed
  pairwise order ((c0 + c1) + (c2 + c3)) + ... (`tree_sum`) on every device;
- what follows (the normalisation by the summed weight, the global gradient norm, the
  optimizer update with its clipping) runs on whole, replicated arrays inside the same
  `shard_map`, so no reduction in it is split over devices; the jit's output shardings
  then cut the new state back to its FSDP layout (a slice: exact).

A step of your own (`jtrain.step.Step`) runs whole on every device (`replicated`): the
same bits on any topology, at the price of no data parallelism for its update.

The cost: every device holds the whole params, gradients and optimizer state during the
update (FSDP's memory saving is gone for the step) plus the K chunk gradients gathered
for the sum; the forward and backward stay data-parallel.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from jtrain import metrics as metrics_lib
from jtrain.errors import ConfigError

BATCH_AXES = ("data", "fsdp")


def tree_sum(items: list, add: Callable = jnp.add):
    """items[0] + items[1] + ... added pairwise in a fixed order: ((x0 + x1) + (x2 + x3))
    + ...; an odd one out is carried to the next level unchanged."""
    if not items:
        raise ValueError("tree_sum of nothing")
    items = list(items)
    while len(items) > 1:
        paired = [add(items[i], items[i + 1]) for i in range(0, len(items) - 1, 2)]
        items = paired + ([items[-1]] if len(items) % 2 else [])
    return items[0]


def _is_collection(x) -> bool:
    return isinstance(x, metrics_lib.MetricCollection)


def _add(a, b):
    """Two chunks' results added: metric states merge, arrays add."""
    return jax.tree.map(lambda x, y: x.merge(y) if _is_collection(x) else x + y, a, b,
                        is_leaf=_is_collection)


def sum_stacked(stacked, k: int):
    """A pytree whose leaves carry a leading chunk axis of size k -> the `tree_sum` of
    its k slices (metric states merged in the same order)."""
    return tree_sum([jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(k)], _add)


def chunked(batch, k: int):
    """[B, ...] -> [k, B/k, ...]: chunk c holds rows c*B/k ... (c+1)*B/k - 1. The batch
    axis is sharded in contiguous blocks, so a device's chunks are its own rows."""
    return jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)


def _gather(tree):
    """The chunk axis of every leaf gathered from all devices (bits moved, not added)."""
    return jax.tree.map(lambda x: jax.lax.all_gather(x, BATCH_AXES, axis=0, tiled=True),
                        tree)


def chunk_sums(per_chunk: Callable, mesh, k: int, combine: Callable):
    """f(whole, batch, keys) where `per_chunk(whole, chunk, key) -> result` runs on each of
    the k chunks of `batch` (keys: [k] typed keys, one per chunk) on the device holding
    it, and `combine(whole, summed)` gets the `sum_stacked` of the k results on every
    device; f returns what combine returns (replicated). `whole` is every argument held
    whole on every device (params, optimizer state, scalars)."""

    def local(whole, batch, keys):
        with no_constraints():
            results = jax.lax.map(lambda xs: per_chunk(whole, xs[0], xs[1]), (batch, keys))
            return combine(whole, sum_stacked(_gather(results), k))

    def f(whole, batch, keys):
        return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(BATCH_AXES), P(BATCH_AXES)),
                             out_specs=P(), check_vma=False)(whole, chunked(batch, k), keys)

    return f


def no_constraints():
    """Inside a shard_map every array is a device's own: the model's logical sharding
    constraints (flax's rules) are switched off."""
    return nn.logical_axis_rules(())


def chunked_eval(eval_fn: Callable, mesh, k: int) -> Callable:
    """eval_step(params, batch) -> (metric states, row inputs, terms) with the batch cut
    into k chunks: each chunk's states and loss terms on the device holding it, gathered
    and merged in `tree_sum`'s order; the per-row inputs (host-side metrics) stay with
    their rows."""

    def local(params, batch):
        with no_constraints():
            states, inputs, terms = jax.lax.map(lambda c: eval_fn(params, c), batch)
            states, terms = sum_stacked(_gather((states, terms)), k)
            return states, inputs, terms

    def f(params, batch):
        rows = jax.tree.leaves(batch)[0].shape[0]
        if rows % k:
            raise ConfigError("determinism.chunks", f"{k} does not divide the eval batch "
                              f"of {rows} rows")
        states, inputs, terms = jax.shard_map(
            local, mesh=mesh, in_specs=(P(), P(BATCH_AXES)),
            out_specs=(P(), P(BATCH_AXES), P()), check_vma=False)(params, chunked(batch, k))
        return states, jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), inputs), terms

    return f


def replicated(fn: Callable, mesh) -> Callable:
    """fn run whole on every device: every argument and result replicated."""
    def local(*args):
        with no_constraints():
            return fn(*args)
    return jax.shard_map(local, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)


def chunk_keys(key, k: int):
    """One key per chunk: fold_in(key, c)."""
    return jax.vmap(lambda c: jax.random.fold_in(key, c))(jnp.arange(k))
