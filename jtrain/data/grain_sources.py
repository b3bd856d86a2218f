"""grain objects as jtrain data.

* `grain.MapDataset`: a map-style source like any other (jtrain shuffles, shards and
  batches it; see pipeline.py).
* `grain.IterDataset`: a stream of examples (see streams.py); its own iterator state is
  saved, so a resume does not replay the stream.
* `grain.DataLoader`: used as it is (its sampler, sharding, operations and workers), as
  long as it is sharded by JAX process and yields this process's batches of
  data.batch_size / process_count rows; its iterator state is saved.
"""

from __future__ import annotations

import grain
import numpy as np

from jtrain import internals
from jtrain.data import items as items_lib, pipeline
from jtrain.data.items import DataError, first_line
from jtrain.data.streams import EpochEnd, _jsonable


class GrainStream:
    """Opens a grain IterDataset for a shard (every shard reads it whole and keeps its
    elements; shard a grain MapDataset before `to_iter_dataset` to avoid that)."""

    def __init__(self, dataset: grain.IterDataset, name: str):
        self.dataset, self.name = dataset, name

    def declared_len(self):
        return None

    def open(self, epoch: int, shard: int, num_shards: int, seed: int) -> "_RawGrain":
        return _RawGrain(self)

    def __repr__(self) -> str:
        return f"GrainStream({self.name}, {type(self.dataset).__name__})"


class _RawGrain:
    self_sharded = False

    def __init__(self, stream: GrainStream):
        self.stream, self.k, self._it = stream, 0, None

    def next(self):
        if self._it is None:
            self._it = iter(self.stream.dataset)
        try:
            out = next(self._it)
        except StopIteration:
            raise EpochEnd from None
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"{self.stream.name}[element {self.k}]: {type(e).__name__}: "
                            f"{first_line(e)}") from e
        self.k += 1
        return out

    def native_state(self):
        if self._it is None:
            return None
        return _jsonable(self._it.get_state())

    def restore(self, state) -> None:
        self._it = iter(self.stream.dataset)
        self._it.set_state(state)


def is_grain_loader(obj) -> bool:
    return isinstance(obj, grain.DataLoader)


def check_loader_sharding(loader, name: str, process_index: int, process_count: int) -> None:
    got = internals.grain_loader_shard(loader)
    if got != (process_index, process_count):
        raise DataError(
            f"{name}: the grain DataLoader reads shard {got[0]} of {got[1]}, but this is "
            f"process {process_index} of {process_count}; give it "
            "shard_options=grain.sharding.ShardByJaxProcess()")


class LoaderIterator:
    """A grain DataLoader's batches as numpy dicts, with its own iterator state."""

    def __init__(self, loader, *, name: str, local_batch: int, keep_64bit: bool):
        self.loader, self.name, self.local_batch = loader, name, local_batch
        self.keep_64bit, self._it, self._ref, self._count = keep_64bit, None, None, 0
        self._pending = None

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._it is None:
            pipeline.prepare_workers()
            self._it = iter(self.loader)
            if self._pending is not None:
                self._it.set_state(self._pending.encode())
                self._pending = None
        try:
            raw = next(self._it)
        except StopIteration:
            epochs = internals.grain_loader_epochs(self.loader)
            raise DataError(f"{self.name}: the grain DataLoader ended after {self._count} "
                            f"batches (its sampler has num_epochs={epochs}); for training "
                            "give it num_epochs=None") from None
        where = f"{self.name}[batch {self._count}]"
        batch = items_lib.to_numpy_item(raw, where, self.keep_64bit)
        if self._ref is None:
            self._ref = items_lib.signature(batch, batched=True)
        items_lib.check_batch(batch, self._ref, self.local_batch, where)
        self._count += 1
        return batch

    def get_state(self) -> dict:
        if self._it is None:
            return {"kind": "grain_loader", "state": self._pending}
        state = self._it.get_state()
        return {"kind": "grain_loader",
                "state": state.decode() if isinstance(state, bytes) else state}

    def set_state(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("kind") != "grain_loader":
            raise DataError(f"{self.name}: the checkpoint's data position is not one of a "
                            "grain DataLoader (use a new workdir)")
        self.close()
        self._pending = state["state"]

    def close(self) -> None:
        self._it = None


def loader_items(loader, name: str) -> list:
    """Every row of a finite grain DataLoader (for evaluation), as numpy items."""
    if internals.grain_loader_epochs(loader) is None:
        raise DataError(f"{name}: the grain DataLoader repeats forever (num_epochs=None); "
                        "for evaluation give it num_epochs=1")
    rows = []
    pipeline.prepare_workers()
    for b, raw in enumerate(loader):
        batch = items_lib.to_numpy_item(raw, f"{name}[batch {b}]")
        n = len(np.asarray(items_lib.flatten(batch)[0][1]))
        rows.extend(items_lib.tree_map(lambda x, i=i: x[i], batch) for i in range(n))
    return rows
