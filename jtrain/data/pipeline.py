"""The grain pipeline for map-style sources: global batch number -> numpy batch.

    grain.MapDataset.range(position, END)  # global batch numbers, from the resume point
      .map(Load(BatchPlan,  # -> (epoch, number, this process's example indices, validity)
                BatchReader))  # -> items read (global RNGs seeded per batch), numpy batch
      .to_iter_dataset(ReadOptions)        # reader threads + read-ahead
      .mp_prefetch(MultiprocessingOptions) # worker processes (spawned), if data.num_workers

Epoch e is a permutation of the N examples from (seed, e), like DistributedSampler's
set_epoch. Global batch k of the epoch is positions [k*B, (k+1)*B) of that order, and
process p takes rows [p*b, (p+1)*b) of it: processes read disjoint shards, the global
batch does not depend on the number of processes, and the union over processes of what
is read in an epoch is every index exactly once (drop_last=False, or N divisible by B).
With drop_last the N mod B examples left over by an epoch's order are skipped (different
ones each epoch); without it the last batch is padded with copies and a `mask` [b] of 0.

The position is one integer (global batches consumed): a batch is a pure function of its
number, so a resumed run reads exactly the batches the uninterrupted run would have, with
any number of worker processes (grain workers slice the batch numbers i::W and
interleave them back in order) and, unless the dataset draws from a global RNG (seeded
per process and batch, see sources.py), any number of processes.
"""

from __future__ import annotations

from typing import Callable

import grain
import numpy as np

from jtrain.data import items as items_lib
from jtrain.data.items import DataError
from jtrain.losses import ROW_MASK

END = 2**62  # "forever" in batch numbers


class BatchPlan:
    """Global batch number -> (epoch, example indices [b], valid [b])."""

    def __init__(self, n: int, global_batch: int, local_batch: int, process_index: int,
                 seed: int, shuffle: bool, drop_last: bool):
        self.n, self.global_batch, self.local_batch = n, global_batch, local_batch
        self.offset = process_index * local_batch
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.per_epoch = n // global_batch if drop_last else -(-n // global_batch)
        self._cached: tuple = (None, None)

    def order(self, epoch: int) -> np.ndarray:
        cached_epoch, order = self._cached
        if cached_epoch != epoch:
            order = (np.random.default_rng([self.seed, epoch, 0xE90C]).permutation(self.n)
                     if self.shuffle else np.arange(self.n))
            self._cached = (epoch, order)
        return order

    def __call__(self, number: int):
        epoch, k = divmod(int(number), self.per_epoch)
        pos = k * self.global_batch + self.offset + np.arange(self.local_batch)
        valid = pos < self.n
        order = self.order(epoch)
        return epoch, int(number), order[np.where(valid, pos, pos[0] if valid[0] else 0)], valid


class BatchReader:
    """(epoch, indices, valid) -> numpy batch. Runs in a grain thread or worker process."""

    def __init__(self, source, *, name: str, seed: int, collate_fn: Callable | None,
                 ref: dict, mask: bool, keep_64bit: bool, stream: int = 0):
        self.source, self.name, self.seed = source, name, seed
        self.collate_fn, self.ref, self.mask, self.keep_64bit = collate_fn, ref, mask, keep_64bit
        self.stream = stream  # the process index: its rows get their own global-RNG seeds

    def __call__(self, planned) -> dict:
        epoch, number, indices, valid = planned
        raws = self.source.read_batch(indices, epoch, self.seed, number, self.stream)
        batch = collate(raws, indices, name=self.name, collate_fn=self.collate_fn,
                        ref=self.ref, keep_64bit=self.keep_64bit)
        if self.mask:
            batch[ROW_MASK] = valid.astype(np.float32)
        return batch


class Load:
    """plan then read: one grain map stage per batch."""

    def __init__(self, plan: Callable, reader: BatchReader):
        self.plan, self.reader = plan, reader

    def __call__(self, number: int) -> dict:
        return self.reader(self.plan(number))


def collate(raws: list, indices, *, name: str, collate_fn, ref: dict, keep_64bit: bool) -> dict:
    """Raw items -> numpy batch: the default stack (each item checked, by index) or the
    user's collate_fn (its output checked against the first batch's shapes)."""
    if collate_fn is None:
        return items_lib.stack_raw(raws, indices, name, ref, keep_64bit)
    batch = items_lib.collate_with(collate_fn, raws, indices, name, keep_64bit)
    lo, hi = int(np.min(indices)), int(np.max(indices))
    items_lib.check_batch(batch, ref, len(raws), f"{name}[{lo}..{hi}] (collate_fn)")
    return batch


def reference(source, *, name: str, collate_fn, sample: int, keep_64bit: bool,
              read: Callable | None = None) -> tuple[dict, dict]:
    """(signature every batch must match, a sample batch) from the first `sample` items."""
    read = read or source.read
    raws = [read(i) for i in range(sample)]
    if collate_fn is None:
        item0 = items_lib.to_numpy_item(raws[0], f"{name}[0]", keep_64bit)
        ref = items_lib.signature(item0)
        return ref, collate(raws, range(sample), name=name, collate_fn=None, ref=ref,
                            keep_64bit=keep_64bit)
    batch = items_lib.collate_with(collate_fn, raws, range(sample), name, keep_64bit)
    ref = items_lib.signature(batch, batched=True)
    items_lib.check_batch(batch, ref, sample, f"{name}[0..{sample - 1}] (collate_fn)")
    return ref, batch


def read_options(num_threads: int, prefetch: int) -> grain.ReadOptions:
    return grain.ReadOptions(num_threads=num_threads if prefetch else 0,
                             prefetch_buffer_size=prefetch if num_threads else 0)


class MapIterator:
    """Endless per-process batches of a map-style source, with an exact position.

    `get_state()` -> {"kind": "map", "position": global batches consumed, "epoch", ...};
    `set_state()` moves to a position (the pipeline restarts lazily, at the next batch)."""

    def __init__(self, plan: BatchPlan, reader: BatchReader, *, num_workers: int,
                 num_threads: int, prefetch: int, worker_init_fn=None):
        self.plan, self.reader = plan, reader
        self.num_workers, self.num_threads, self.prefetch = num_workers, num_threads, prefetch
        self.worker_init_fn = worker_init_fn
        self.position, self._it = 0, None

    def _start(self):
        ds = grain.MapDataset.range(self.position, END).map(Load(self.plan, self.reader))
        it_ds = ds.to_iter_dataset(read_options(self.num_threads, self.prefetch))
        self._it = iter(with_workers(it_ds, self.num_workers, self.prefetch,
                                     self.worker_init_fn))

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._it is None:
            self._start()
        batch = next(self._it)
        self.position += 1
        return own_memory(batch) if self.num_workers else batch

    def get_state(self) -> dict:
        p = self.plan
        return {"kind": "map", "position": self.position,
                "epoch": self.position // p.per_epoch,
                "batch_in_epoch": self.position % p.per_epoch,
                "batches_per_epoch": p.per_epoch, "num_examples": p.n,
                "global_batch": p.global_batch, "shuffle": p.shuffle,
                "drop_last": p.drop_last}

    def set_state(self, state: dict) -> None:
        p, name = self.plan, self.reader.name
        if not isinstance(state, dict) or state.get("kind") != "map":
            raise DataError(f"{name}: the checkpoint's data position is not one of a "
                            f"map-style dataset ({_kind(state)}); the data changed kind "
                            "since it was saved (use a new workdir)")
        saved = (state.get("num_examples"), state.get("global_batch"), state.get("drop_last"))
        if saved != (p.n, p.global_batch, p.drop_last):
            raise DataError(
                f"{name}: the checkpoint's data position is for {saved[0]} examples, global "
                f"batch {saved[1]}, drop_last={saved[2]}; this run has {p.n}, "
                f"{p.global_batch}, {p.drop_last} (restore those settings or use a new workdir)")
        self.close()
        self.position = int(state["position"])

    def close(self) -> None:
        if self._it is not None:
            if hasattr(self._it, "close"):
                self._it.close()
            self._it = None


def example_indices(data_state: dict | None, seed: int, number: int | None):
    """The global dataset indices of global batch `number` of a map-style train
    iterator whose state is `data_state` (None for a stream: it has no global index)."""
    if number is None or not data_state or data_state.get("kind") != "map":
        return None
    b = int(data_state["global_batch"])
    plan = BatchPlan(int(data_state["num_examples"]), b, b, 0, seed,
                     bool(data_state["shuffle"]), bool(data_state["drop_last"]))
    _, _, indices, valid = plan(number)
    return [int(i) for i in indices[valid]]


def with_workers(ds: grain.IterDataset, num_workers: int, prefetch: int, worker_init_fn):
    """`ds` read by `num_workers` spawned grain worker processes (none: `ds` itself).

    A torch DataLoader's num_workers becomes data.num_workers and its dataset is read by
    these workers (the DataLoader itself is never iterated, so torch starts none)."""
    if not num_workers:
        return ds
    prepare_workers()
    return ds.mp_prefetch(grain.MultiprocessingOptions(
        num_workers=num_workers, per_worker_buffer_size=max(1, prefetch)),
        worker_init_fn=worker_init_fn)


def prepare_workers() -> None:
    """Called before jtrain starts grain worker processes: here (mp_prefetch) and when it
    iterates a user's grain DataLoader (grain_sources.py; its workers are mp_prefetch
    too). grain starts them with the "spawn" context, never `fork` beside a live JAX
    runtime. It reads absl flags while doing so, which raises UnparsedFlagAccessError in
    a plain script (no absl.app owns the process): marked parsed then, if nobody has."""
    from jtrain import boot

    boot.mark_absl_parsed()


def own_memory(batch: dict) -> dict:
    """Batches from grain workers live in shared memory, freed when the array is; a
    device array may alias host memory, so hand out plain copies and let grain free
    its segments now, not at exit (or never)."""
    return items_lib.tree_map(np.array, batch)


def _kind(state) -> str:
    return f"kind {state.get('kind')!r}" if isinstance(state, dict) and "kind" in state \
        else "an older format"


class EvalPlan:
    """Global eval batch g holds examples [g*B, (g+1)*B); process p takes its b rows;
    rows past the end repeat example 0 with mask 0."""

    def __init__(self, n: int, global_batch: int, local_batch: int, process_index: int):
        self.n, self.global_batch, self.local_batch = n, global_batch, local_batch
        self.offset = process_index * local_batch

    def __call__(self, g: int):
        pos = int(g) * self.global_batch + self.offset + np.arange(self.local_batch)
        valid = pos < self.n
        return 0, int(g), np.where(valid, pos, 0), valid


class LocalPlan:
    """Eval batch g = rows [g*b, (g+1)*b) of this process's rows; past the end, row 0
    again with mask 0."""

    def __init__(self, n: int, local_batch: int):
        self.n, self.local_batch = n, local_batch

    def __call__(self, g: int):
        pos = int(g) * self.local_batch + np.arange(self.local_batch)
        valid = pos < self.n
        return 0, int(g), np.where(valid, pos, 0), valid
