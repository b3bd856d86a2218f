"""`Data`: one dataset as jtrain reads it, one small class per input kind behind one
protocol. What differs between kinds is a method here, never a switch on a kind name.

    MapData     a map-style source (len + read): torch Dataset, grain MapDataset, arrays
    StreamData  a stream that opens per shard: torch IterableDataset, grain IterDataset
    LoaderData  a grain DataLoader, used as it is
    ListData    an eval set read into memory (this process's rows of a stream or loader)

Objects are treated as values: `checks.check`, `with_transform` and `split_off_eval`
return new ones and leave their input as it was.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

from jtrain.data import grain_sources, items as items_lib, pipeline, streams
from jtrain.data.items import DataError
from jtrain.data.sources import Subset, Transformed, split_indices


@dataclasses.dataclass
class Data:
    """The protocol every kind implements; see the module docstring."""
    name: str
    source: Any
    description: str
    collate_fn: Callable | None = None
    worker_init_fn: Callable | None = None
    notes: list = dataclasses.field(default_factory=list)
    holdout: tuple | None = None  # streams: (fraction, split_seed, keep the held-out part)
    # Set only by `checks.check`, which returns a checked copy (the input is not changed):
    ref: dict | None = None       # the signature every batch must match
    sample: dict | None = None    # a checked sample batch (numpy, rows = examples)
    count: int | None = None      # examples, where known

    kind: ClassVar[str] = "data"  # for the header, the data info and messages
    in_memory: ClassVar[bool] = False  # eval batches can be read from it directly

    @property
    def known_size(self) -> int | None:
        """Examples, where known: exact for map-style data, declared for streams."""
        return self.count

    def __len__(self) -> int:
        """Examples (map-style: exact; streams: declared or seen, 0 if unknown)."""
        return int(self.known_size or 0)

    def __getitem__(self, index: int) -> dict:
        """Example `index` as the model sees it (after collate_fn), numpy."""
        if self.ref is None:
            raise DataError(f"{self.name}: not checked yet (jtrain.data.checks.check returns "
                            "the checked dataset)")
        if index == 0:
            return items_lib.tree_map(lambda x: x[0], self.sample)
        return self._example(index)

    def _example(self, index: int) -> dict:
        raise DataError(f"{self.name}: a stream has no random access (only example 0 of "
                        "the checked sample)")

    def with_transform(self, fn: Callable) -> Data:
        raise DataError(f"{self.name}: random transforms work on map-style datasets, not on "
                        f"{self.description}")

    def split_off_eval(self, fraction: float, split_seed: int) -> tuple[Data, Data | None]:
        """(train, eval) with data.val_fraction held out for eval, seeded by
        data.split_seed (independent of the run's seed: every run holds out the same)."""
        raise NotImplementedError

    def train_iterator(self, *, local_batch: int, seed: int, shuffle: bool, process_index: int,
                       process_count: int, num_workers: int, drop_last: bool, prefetch: int,
                       num_threads: int):
        """Endless per-process batches with get_state() / set_state()."""
        raise NotImplementedError

    def batch_reader(self, *, seed: int, mask: bool, stream: int) -> pipeline.BatchReader:
        """(epoch, indices, valid) -> a checked numpy batch of this data's items, `mask`
        [b] added when `mask`; `stream` (the process index) seeds global RNGs per process.
        Used by the kinds jtrain batches itself (not a grain DataLoader)."""
        return pipeline.BatchReader(self.source, name=self.name, seed=seed,
                                    collate_fn=self.collate_fn, ref=self.ref, mask=mask,
                                    keep_64bit=items_lib.x64_enabled(), stream=stream)


@dataclasses.dataclass
class MapData(Data):
    kind: ClassVar[str] = "map"
    in_memory: ClassVar[bool] = True

    @property
    def known_size(self) -> int:
        return len(self.source)

    def _example(self, index: int) -> dict:
        batch = pipeline.collate([self.source.read(index)], [index], name=self.name,
                                 collate_fn=self.collate_fn, ref=self.ref,
                                 keep_64bit=items_lib.x64_enabled())
        return items_lib.tree_map(lambda x: x[0], batch)

    def with_transform(self, fn: Callable) -> Data:
        """`fn(item, rng)` on every item read, rng from (seed, epoch, index)."""
        return dataclasses.replace(
            self, source=Transformed(self.source, fn, self.name),
            notes=self.notes + [f"random transform {getattr(fn, '__name__', 'fn')}(item, rng)"])

    def split_off_eval(self, fraction, split_seed):
        n = len(self.source)
        keep, held = split_indices(n, fraction, split_seed)
        ev = dataclasses.replace(self, name="eval_data", notes=[],
                                 source=Subset(self.source, held, "eval_data"))
        train = dataclasses.replace(
            self, source=Subset(self.source, keep, self.name),
            notes=self.notes + [f"{len(held):,} of {n:,} examples held out for eval "
                                f"(data.val_fraction={fraction})"])
        return train, ev

    def train_iterator(self, *, local_batch, seed, shuffle, process_index, process_count,
                       num_workers, drop_last, prefetch, num_threads):
        reader = self.batch_reader(seed=seed, mask=not drop_last, stream=process_index)
        plan = pipeline.BatchPlan(len(self.source), local_batch * process_count, local_batch,
                                  process_index, seed, shuffle, drop_last)
        return pipeline.MapIterator(plan, reader, num_workers=num_workers,
                                    num_threads=num_threads, prefetch=prefetch,
                                    worker_init_fn=self.worker_init_fn)

    def eval_plan(self, local_batch: int, process_index: int, process_count: int):
        """(number of eval batches, the plan of rows) on every process alike."""
        n = len(self.source)
        return (-(-n // (local_batch * process_count)),
                pipeline.EvalPlan(n, local_batch * process_count, local_batch, process_index))


@dataclasses.dataclass
class ListData(MapData):
    """This process's eval rows in memory (`source` is an evalsets.ListSource)."""
    kind: ClassVar[str] = "list"

    @property
    def known_size(self) -> int:
        return int(self.count or 0)

    def eval_plan(self, local_batch, process_index, process_count):
        return (-(-self.source.local_max // local_batch),
                pipeline.LocalPlan(self.source.num_valid, local_batch))


@dataclasses.dataclass
class StreamData(Data):
    kind: ClassVar[str] = "stream"

    def split_off_eval(self, fraction, split_seed):
        ev = dataclasses.replace(self, name="eval_data", notes=[],
                                 holdout=(fraction, split_seed, True))
        train = dataclasses.replace(
            self, holdout=(fraction, split_seed, False),
            notes=self.notes + [f"a seeded {fraction:.0%} of the stream held out for eval "
                                "(data.val_fraction)"])
        return train, ev

    def train_iterator(self, *, local_batch, seed, shuffle, process_index, process_count,
                       num_workers, drop_last, prefetch, num_threads):
        reader = self.batch_reader(seed=seed, mask=not drop_last, stream=process_index)
        batches = streams.StreamBatches(
            self.source, process_index=process_index, process_count=process_count,
            local_batch=local_batch, seed=seed, drop_last=drop_last, reader=reader,
            holdout=self.holdout, num_workers=max(1, num_workers))
        return streams.StreamIterator(batches, num_workers=num_workers, prefetch=prefetch,
                                      worker_init_fn=self.worker_init_fn)

    def local_rows(self, process_index: int, process_count: int, workers: int,
                   limit: int | None) -> list:
        """This process's raw eval items. A held-out part of a stream that splits itself
        must use the shards training uses (worker w of process p is shard p*W + w), or
        the parts would overlap."""
        w = workers if self.holdout is not None else 1
        rows: list = []
        for s in range(process_index * w, (process_index + 1) * w):
            rows += streams.read_shard(self.source, shard=s, num_shards=process_count * w,
                                       seed=0, holdout=self.holdout,
                                       limit=None if limit is None else limit - len(rows))
        return rows

    def first_row(self) -> list:
        """One raw item (to pad a process that has no eval rows of its own)."""
        return streams.read_shard(self.source, shard=0, num_shards=1, seed=0,
                                  holdout=self.holdout, limit=1)


@dataclasses.dataclass
class LoaderData(Data):
    kind: ClassVar[str] = "grain_loader"

    def split_off_eval(self, fraction, split_seed):
        return dataclasses.replace(
            self, notes=self.notes + ["no eval split of a grain DataLoader (pass eval_data)"]), None

    def train_iterator(self, *, local_batch, **_):
        """The DataLoader's own batches (its sampler, workers and state): jtrain reads no
        items of it, so no batch reader."""
        return grain_sources.LoaderIterator(self.source, name=self.name,
                                            local_batch=local_batch,
                                            keep_64bit=items_lib.x64_enabled())

    def first_batch(self, local_batch: int, process_index: int, process_count: int) -> dict:
        """The DataLoader's first batch (numpy), once it is known to read this
        process's shard."""
        grain_sources.check_loader_sharding(self.source, self.name, process_index,
                                            process_count)
        return next(grain_sources.LoaderIterator(self.source, name=self.name,
                                                 local_batch=local_batch,
                                                 keep_64bit=items_lib.x64_enabled()))

    def local_rows(self, process_index: int, process_count: int, workers: int,
                   limit: int | None) -> list:
        grain_sources.check_loader_sharding(self.source, self.name, process_index,
                                            process_count)
        return grain_sources.loader_items(self.source, self.name)

    def first_row(self) -> list:
        return grain_sources.loader_items(self.source, self.name)[:1]
