"""Evaluation data: every example exactly once, padded batches with a `mask` [b], the
same number of batches on every process (the eval step is a collective and compiles once).

Map-style eval sets are read in place (global batch g = examples [g*B, (g+1)*B), process
p takes its b rows). Streams and grain DataLoaders are read once, at setup, into memory:
each process keeps its own shard, the processes agree on the largest shard, and batch g
of every process is rows [g*b, (g+1)*b) of its own shard, padded.
"""

from __future__ import annotations

import grain

from jtrain.data import pipeline
from jtrain.data.dataset import Data, ListData
from jtrain.errors import DataError


MAX_EVAL_STREAM = 1_000_000  # examples per process read into memory from an eval stream


class ListSource:
    """This process's eval examples, in memory (raw items, as the dataset gave them)."""

    def __init__(self, items: list, name: str, local_max: int, num_valid: int):
        # items[0] exists even when this process has no rows (num_valid 0): it pads.
        self.items, self.name, self.local_max, self.num_valid = items, name, local_max, num_valid

    def __len__(self) -> int:
        return len(self.items)

    def read(self, index: int, epoch: int = 0, seed: int = 0):
        return self.items[int(index)]

    def read_batch(self, indices, epoch: int, seed: int, key: int, stream: int = 0) -> list:
        return [self.items[int(i)] for i in indices]

    check_read = read

    def __repr__(self) -> str:
        return f"ListSource({self.name}, n={len(self)})"


def read_eval_set(data: Data, *, process_index: int, process_count: int,
                  workers: int = 1, gather=None) -> ListData:
    """A stream or grain DataLoader eval set, read into memory (this process's shard).

    `gather(n)` -> [n of every process]: the one collective, done by the caller's device
    layer (`jtrain.mesh.process_values`); this module stays numpy-only."""
    if gather is None:
        if process_count > 1:
            raise ValueError("read_eval_set: several processes need gather= "
                             "(jtrain.mesh.process_values)")
        gather = lambda n: [n]  # noqa: E731
    name = data.name
    rows = data.local_rows(process_index, process_count, workers, limit=MAX_EVAL_STREAM + 1)
    if len(rows) > MAX_EVAL_STREAM:
        raise DataError(f"{name}: the eval stream gave more than {MAX_EVAL_STREAM:,} "
                        "examples to this process without ending; an eval stream must "
                        "end (or pass a map-style eval set)")
    counts = gather(len(rows))  # every process's row count, in process order
    total, local_max = sum(counts), max(counts)
    if total == 0:
        raise DataError(f"{name}: the eval data is empty")
    num_valid = len(rows)
    if not rows:  # other processes have rows: borrow one to pad with (mask 0)
        rows = data.first_row()
    return ListData(name, ListSource(rows, name, local_max, num_valid), data.description,
                    collate_fn=data.collate_fn, notes=list(data.notes), count=total)


def eval_batches(data: Data, *, local_batch: int, process_index: int, process_count: int,
                 max_batches: int = 0, num_threads: int = 1, prefetch: int = 2):
    """Batches of `data` (checked: `jtrain.data.checks.check`) for `data.eval_plan`."""
    if not data.in_memory:
        raise DataError(f"{data.name}: eval data of kind {data.kind} must be read with "
                        "jtrain.data.make_sources first")
    reader = data.batch_reader(seed=0, mask=True, stream=process_index)
    num, plan = data.eval_plan(local_batch, process_index, process_count)
    if max_batches:
        num = min(num, max_batches)
    ds = grain.MapDataset.range(num).map(pipeline.Load(plan, reader))
    it = iter(ds.to_iter_dataset(pipeline.read_options(num_threads, prefetch)))
    try:
        yield from it
    finally:
        if hasattr(it, "close"):
            it.close()
