"""Topology-invariant steps (`determinism.topology_invariant`): the same bits on 1, 2, 4
or 8 devices, in one process or several, and across an elastic resume.

A psum or a reduction over a sharded axis adds partial sums in an order that depends on
how many devices hold the parts, and XLA compiles a program for one device through
other passes than a partitioned one (its algebraic simplifier, for one, rewrites some
divisions into multiplications by a reciprocal), so the same run on 1, 2 and 8 devices
differs in the last bits. Here the arithmetic runs only in programs compiled for ONE
device, the same ones on every device count, and what crosses devices only moves bits:

- the global batch is cut into `determinism.chunks` (K) equal chunks of consecutive rows,
  whatever the device count; each device holds K / (data x fsdp) of them. The first
  program (compiled for one device, run on every device on its own rows) runs the
  per-chunk step on each of its chunks, one after the other (`each_chunk`);
- the chunk results (loss and weight sums, gradients, metric states, the model's state)
  are assembled into one array sharded on the batch axes and made replicated (an
  all-gather moves bits, it adds nothing);
- the second program (compiled for one device, run on every device on its whole copy)
  adds the K results in the fixed pairwise order ((c0 + c1) + (c2 + c3)) + ...
  (`tree_sum`) and runs the rest of the update (the normalisation by the summed weight,
  the global gradient norm, the optimizer with its clipping, the guard) on whole arrays;
  the new state is then cut back to its FSDP layout (a slice: exact).

The step is therefore a Python callable that dispatches these programs (`SplitStep`,
`SplitEval`, `Whole`), not one jit: the state is not donated (the old state is freed
when the caller drops it), and `lower(...).compile()` compiles the programs for the
first device and reports the larger one's memory plus the state held beside it (the
dry run, the memory plan). Each program is compiled for the first device and its
executable loaded onto the others (`_Program`): every device runs the same machine
code.

A step of your own (`jtrain.step.Step`) runs whole on every device (`Whole`): the same
bits on any topology, at the price of no data parallelism for its update.

The cost: every device holds the whole params, gradients and optimizer state during the
update (FSDP's memory saving is gone for the step) plus the K chunk results gathered for
the sum; the forward and backward stay data-parallel.
"""

from __future__ import annotations

import types
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jtrain import internals, metrics as metrics_lib
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


def each_chunk(fn: Callable, shared, xs, ids):
    """[fn(shared, x) for x in xs] stacked, over this device's chunks (`ids`: their global
    indices), computed the same way for 1 chunk as for 8: each chunk's arithmetic sits in
    one loop body between optimization barriers (the chunk, the index and `shared` in,
    the result out), so the compiler neither hoists work on `shared` (the params, the
    model's state) out of the loop nor fuses a lone chunk with what surrounds it. Without
    them 8 chunks on one device and one chunk on each of 8 devices compiled BatchNorm's
    momentum update differently (the variance differed in its last bit)."""
    n = (ids >= 0).sum()  # = len(ids) (chunk indices are >= 0), known only at run time
    first = jax.tree.map(lambda x: x[0], xs)
    shapes = jax.eval_shape(fn, shared, first)
    out = jax.tree.map(lambda s: jnp.zeros((ids.shape[0], *s.shape), s.dtype), shapes)

    def body(i, acc):
        x = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, False), xs)
        _, inputs, x = jax.lax.optimization_barrier((i, shared, x))
        result = jax.lax.optimization_barrier(fn(inputs, x))
        return jax.tree.map(lambda a, r: jax.lax.dynamic_update_index_in_dim(a, r, i, 0),
                            acc, result)

    return jax.lax.fori_loop(0, n, body, out)


def no_constraints():
    """In a program compiled for one device every array is whole there: the model's
    logical sharding constraints (flax's rules) are switched off."""
    return nn.logical_axis_rules(())


def chunk_keys(key, ids):
    """One key per chunk: fold_in(key, c) for each global chunk index c of `ids`."""
    return jax.vmap(lambda c: jax.random.fold_in(key, c))(ids)


def check_rows(rows: int, k: int, what: str = "the eval batch") -> None:
    if rows % k:
        raise ConfigError("determinism.chunks", f"{k} does not divide {what} of {rows} rows")


# -- one-device programs on every device --------------------------------------------------


class _Program:
    """fn as a program compiled for one device, run on every device: compiled once for
    the first device (per argument shapes), its executable then loaded onto each other
    device, so every device runs the same machine code (and N devices cost one compile).
    Otherwise (`_can_move`), each device compiles the same program itself.

    Traced without the model's sharding constraints; its name has a leading underscore
    (observe/compiles.py: not a recompile)."""

    def __init__(self, fn: Callable):
        def run(*args):
            with no_constraints():
                return fn(*args)
        run.__name__ = run.__qualname__ = "_" + getattr(fn, "__name__", "program").lstrip("_")
        self.jitted = jax.jit(run)
        self._loaded: dict = {}  # (signature, device) -> compiled

    def __call__(self, calls: list, devices: list) -> list:
        """calls[i]: the arguments on devices[i] -> the results, one per device."""
        key = _signature(calls[0])
        if (key, devices[0]) not in self._loaded:
            self._loaded[(key, devices[0])] = self.jitted.lower(*calls[0]).compile()
        first = self._loaded[(key, devices[0])]
        for d, args in zip(devices[1:], calls[1:], strict=True):
            if (key, d) not in self._loaded:
                self._loaded[(key, d)] = (_moved(first, d, self.jitted, args) if _can_move()
                                          else self.jitted.lower(*args).compile())
        return [self._loaded[(key, d)](*args) for d, args in zip(devices, calls, strict=True)]

    def lower(self, *abstract):
        """Lowered for the device of `abstract`; its compile() is kept for the first
        call (compile.precompile's work is not done twice)."""
        return _Kept(self, _signature(abstract), self.jitted.lower(*abstract),
                     next(iter(jax.tree.leaves(abstract)[0].sharding.device_set)))


class _Kept:
    """A program's lowering whose compile() it keeps for that device."""

    def __init__(self, program: _Program, key, lowered, device):
        self.program, self.key, self.lowered, self.device = program, key, lowered, device

    def compile(self):
        compiled = self.lowered.compile()
        self.program._loaded.setdefault((self.key, self.device), compiled)
        return compiled


def _can_move() -> bool:
    """Whether a compiled executable is moved to the other devices: one process and no
    persistent compilation cache. On XLA:CPU an executable that came from the cache (or,
    with several processes, was written to it) lost functions when serialized again:
    moved, it failed at its first run ("Function ... not found")."""
    return jax.process_count() == 1 and not jax.config.jax_compilation_cache_dir


def _signature(args) -> tuple:
    leaves, treedef = jax.tree.flatten(args)
    return treedef, tuple((x.shape, x.dtype, bool(getattr(x, "weak_type", False)))
                          for x in leaves)


def _moved(compiled, device, jitted, args):
    """`compiled` (for one device) loaded onto `device`: its executable serialized and
    deserialized with that device's assignment, as JAX's persistent compilation cache
    does for an entry compiled on another device; else compiled there."""
    try:
        return internals.load_compiled_on(compiled, device)
    except Exception:  # noqa: BLE001 - the same program, compiled on that device
        return jitted.lower(*args).compile()


def _off_mesh(method: Callable) -> Callable:
    """Runs a method outside the caller's mesh context (`jax.set_mesh`): a program
    compiled for one device takes arrays on that device alone."""
    def run(self, *args):
        with jax.set_mesh(None):
            return method(self, *args)
    run.__name__, run.__doc__ = method.__name__, method.__doc__
    return run


class _OnEachDevice:
    """What the split programs share: the mesh's devices of this process in the batch's
    block order, the bit-moving gathers and scatters, per-device views of global arrays
    and global arrays assembled from per-device results."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.replicated = NamedSharding(mesh, P())
        self.stacked = NamedSharding(mesh, P(BATCH_AXES))
        here = jax.process_index()
        self.devices = [d for d in mesh.devices.flat if d.process_index == here]
        self.blocks = int(mesh.devices.size)  # data x fsdp: tensor > 1 is refused
        self._reshard: dict = {}  # target shardings -> jit(identity)

    def gather(self, tree):
        """Every leaf whole on every device: a reshard (an all-gather moves bits)."""
        return self.reshard(tree, self.replicated)

    def reshard(self, tree, shardings):
        """tree's leaves in `shardings` (a prefix tree of tree), by a program that only
        moves bits (an all-gather, a slice); a leaf already replicated where the target
        is replicated too stays as it is."""
        leaves, treedef = jax.tree.flatten(tree)
        targets = jax.tree.leaves(jax.tree.map(
            lambda s, sub: jax.tree.map(lambda _: s, sub), shardings, tree))
        todo = [i for i, (x, t) in enumerate(zip(leaves, targets, strict=True))
                if not (t.is_fully_replicated and x.sharding.is_fully_replicated)]
        if todo:
            key = tuple(targets[i] for i in todo)
            if key not in self._reshard:
                self._reshard[key] = jax.jit(_identity, out_shardings=list(key))
            for i, x in zip(todo, self._reshard[key]([leaves[i] for i in todo]),
                            strict=True):
                leaves[i] = x
        return treedef.unflatten(leaves)

    def local(self, tree) -> list:
        """One tree per device of this process: that device's shard of every leaf."""
        leaves, treedef = jax.tree.flatten(tree)
        shards = [{s.device: s.data for s in x.addressable_shards} for x in leaves]
        return [treedef.unflatten([m[d] for m in shards]) for d in self.devices]

    def whole(self, trees: list):
        """Per-device results that are equal copies -> replicated global arrays."""
        return self._assemble(trees, self.replicated, lambda shape: shape)

    def blocks_of(self, trees: list):
        """Per-device results, device i's holding block i of the leading axis -> global
        arrays sharded on the batch axes."""
        return self._assemble(trees, self.stacked,
                              lambda shape: (shape[0] * self.blocks, *shape[1:]))

    def _assemble(self, trees, sharding, global_shape):
        leaves = [jax.tree.leaves(t) for t in trees]
        treedef = jax.tree.structure(trees[0])
        return treedef.unflatten([
            jax.make_array_from_single_device_arrays(
                global_shape(parts[0].shape), sharding, list(parts))
            for parts in zip(*leaves, strict=True)])

    def one_device(self, abstract, shape: Callable = lambda s: s):
        """ShapeDtypeStructs on the first device (what `lower` compiles for)."""
        on = SingleDeviceSharding(self.devices[0])
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(shape(a.shape), a.dtype,
                                                            sharding=on), abstract)


def _identity(tree):
    return tree


class Whole(_OnEachDevice):
    """fn(*args) compiled for one device and run whole on every device of `mesh`: the
    arguments gathered, the results assembled and cut to `out_shardings` (a prefix
    tree of the results; default replicated). A step of your own in the mode."""

    def __init__(self, fn: Callable, mesh, out_shardings=None):
        super().__init__(mesh)
        self.fn = _Program(fn)
        self.out_shardings = out_shardings or self.replicated

    @_off_mesh
    def __call__(self, *args):
        copies = self.local(self.gather(args))
        return self.reshard(self.whole(self.fn(copies, self.devices)), self.out_shardings)

    @_off_mesh
    def lower(self, *abstract):
        return _Lowered([self.fn.lower(*self.one_device(abstract))])


class SplitStep(_OnEachDevice):
    """The built-in update in the mode: `first(state, rows, chunk_ids) -> results
    stacked over this device's chunks` on each device's rows, the results gathered,
    `second(state, stacked, rows_ok) -> (state, metrics)` on every device's whole copy
    (`rows_ok`: `validity(batch)`, each row's validity, computed on the mesh), the new
    state cut back to `state_shardings`."""

    def __init__(self, first: Callable, second: Callable, validity: Callable, mesh, k: int,
                 state_shardings):
        super().__init__(mesh)
        self.k = k
        self.first, self.second = _Program(first), _Program(second)
        self.validity = jax.jit(validity, out_shardings=self.replicated)
        self.out_shardings = (state_shardings, self.replicated)
        self._ids: dict = {}

    def chunk_ids(self, batch) -> list:
        """Each device's global chunk indices (constant per batch size; kept on device)."""
        x = jax.tree.leaves(batch)[0]
        if x.shape[0] not in self._ids:
            check_rows(x.shape[0], self.k, "data.batch_size")
            per_chunk = x.shape[0] // self.k
            start = {s.device: s.index[0].start or 0 for s in x.addressable_shards}
            self._ids[x.shape[0]] = [jax.device_put(np.arange(
                start[d] // per_chunk, start[d] // per_chunk + self.k // self.blocks,
                dtype=np.int32), d) for d in self.devices]
        return self._ids[x.shape[0]]

    @_off_mesh
    def __call__(self, state, batch):
        states = self.local(self.gather(state))
        rows_ok = self.local(self.validity(batch))
        parts = self.first(list(zip(states, self.local(batch), self.chunk_ids(batch),
                                    strict=True)), self.devices)
        stacked = self.local(self.gather(self.blocks_of(parts)))
        return self.reshard(self.whole(self.second(
            list(zip(states, stacked, rows_ok, strict=True)), self.devices)),
            self.out_shardings)

    @_off_mesh
    def lower(self, state, batch):
        rows = jax.tree.leaves(batch)[0].shape[0]
        state1 = self.one_device(state)
        rows1 = self.one_device(batch, lambda s: (s[0] // self.blocks, *s[1:]))
        ids1 = self.one_device(jax.ShapeDtypeStruct((self.k // self.blocks,), jnp.int32))
        part = jax.eval_shape(self.first.jitted, state1, rows1, ids1)
        stacked1 = self.one_device(part, lambda s: (self.k, *s[1:]))
        ok1 = self.one_device(jax.ShapeDtypeStruct((rows,), jnp.bool_))
        resident = sum(jax.tree.leaves(jax.tree.map(
            lambda x, sh: int(np.prod(sh.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize,
            state, self.out_shardings[0])))
        return _Lowered([self.first.lower(state1, rows1, ids1),
                         self.second.lower(state1, stacked1, ok1)], resident)


class SplitEval(_OnEachDevice):
    """eval_step(params, batch) -> (metric states, row inputs, terms) with the batch cut
    into k chunks: each device's chunks' states and loss terms computed by one program
    for one device, gathered and merged in `tree_sum`'s order by a second; the per-row
    inputs (host-side metrics) stay with their rows."""

    def __init__(self, eval_fn: Callable, mesh, k: int):
        super().__init__(mesh)
        self.k = k

        def _eval_chunks(params, rows):
            states, inputs, terms = jax.lax.map(
                lambda c: eval_fn(params, c), chunked(rows, k // self.blocks))
            return (states, terms), jax.tree.map(
                lambda x: x.reshape(-1, *x.shape[2:]), inputs)

        def _eval_sum(stacked):
            return sum_stacked(stacked, k)

        self.first, self.second = _Program(_eval_chunks), _Program(_eval_sum)

    @_off_mesh
    def __call__(self, params, batch):
        check_rows(jax.tree.leaves(batch)[0].shape[0], self.k)
        copies = self.local(self.gather(params))
        parts = self.first(list(zip(copies, self.local(batch), strict=True)), self.devices)
        stacked = self.local(self.gather(self.blocks_of([p[0] for p in parts])))
        states, terms = self.whole(self.second([(s,) for s in stacked], self.devices))
        return states, self.blocks_of([p[1] for p in parts]), terms

    @_off_mesh
    def lower(self, params, batch):
        params1 = self.one_device(params)
        rows1 = self.one_device(batch, lambda s: (s[0] // self.blocks, *s[1:]))
        part = jax.eval_shape(self.first.jitted, params1, rows1)[0]
        stacked1 = self.one_device(part, lambda s: (self.k, *s[1:]))
        return _Lowered([self.first.lower(params1, rows1), self.second.lower(stacked1)])


class _Lowered:
    """`lower(...)` of a split step: `compile()` compiles each program for one device.
    `resident`: bytes per device held beside them all step long (the state in its own
    layout, not donated)."""

    def __init__(self, lowered: list, resident: int = 0):
        self.lowered, self.resident = lowered, resident

    def compile(self) -> "_Compiled":
        return _Compiled([lowered.compile() for lowered in self.lowered], self.resident)


_MEMORY = ("argument", "output", "alias", "temp", "generated_code")


class _Compiled:
    """The compiled programs of a split step. `memory_analysis()`: the fields of the one
    whose arguments, outputs and temporaries need the most bytes (they run one after
    the other on a device), the resident bytes added to its arguments."""

    def __init__(self, compiled: list, resident: int = 0):
        self.compiled, self.resident = compiled, resident

    def memory_analysis(self):
        analyses = [c.memory_analysis() for c in self.compiled]
        if any(m is None for m in analyses):
            return None
        peak = max(analyses, key=lambda m: m.argument_size_in_bytes + m.output_size_in_bytes
                   - m.alias_size_in_bytes + m.temp_size_in_bytes)
        fields = {f"{k}_size_in_bytes": int(getattr(peak, f"{k}_size_in_bytes", 0))
                  for k in _MEMORY}
        fields["argument_size_in_bytes"] += self.resident
        return types.SimpleNamespace(**fields)

    def as_text(self) -> str:
        return "\n".join(c.as_text() for c in self.compiled)
