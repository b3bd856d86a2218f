"""Streams (a torch IterableDataset, a grain IterDataset, any re-iterable object): split
per process, batched per epoch, with an exact position.

A stream is read in shards: with P processes and W worker processes each, shard
s = p*W + w of S = P*W. A stream that splits itself the way torch users write it (it
reads `torch.utils.data.get_worker_info()`) is given a WorkerInfo(id=s, num_workers=S)
and yields only its shard; any other stream is read whole by every shard, which keeps
elements k with k mod S == s. Either way the shards are disjoint and cover the stream.

Epoch e re-opens the stream (calling `set_epoch(e)` first where the dataset has it, as
torch users do with DistributedSampler). A batch never spans two epochs: the last
partial batch of a shard's epoch is dropped (data.drop_last) or padded with `mask` 0.

The position of a shard is (epoch, raw elements drawn this epoch). On restore the stream
is re-opened and that many elements are drawn again (or, for grain iterators, their own
state is set), so a resumed run sees exactly the same elements: streams must give the
same elements in the same order for the same epoch (as DistributedSampler requires).
Torch's global RNG is seeded per element from (seed, epoch, shard, element).
"""

from __future__ import annotations

import grain
import numpy as np

from jtrain.data import pipeline
from jtrain.data.sources import (DOMAIN_HOLDOUT, DOMAIN_STREAM, DOMAIN_WORKER, GlobalRng,
                                 call_item, item_seed)
from jtrain.errors import DataError, first_line
from jtrain.losses import ROW_MASK


class EpochEnd(Exception):
    pass


class IterableStream:
    """Opens a re-iterable object (torch IterableDataset or other) for a shard."""

    def __init__(self, dataset, name: str):
        if iter(dataset) is dataset:
            raise DataError(f"{name}: an iterator or generator can be read only once and "
                            "cannot resume; pass an object whose __iter__ starts a new pass "
                            "(e.g. a torch IterableDataset)")
        self.dataset, self.name = dataset, name
        self.torch = GlobalRng(dataset, always=True).torch

    def declared_len(self) -> int | None:
        try:
            return int(len(self.dataset))
        except Exception:
            return None

    def open(self, epoch: int, shard: int, num_shards: int, seed: int) -> "_RawIterable":
        return _RawIterable(self, epoch, shard, num_shards, seed)

    def __repr__(self) -> str:
        return f"IterableStream({self.name}, {type(self.dataset).__name__})"


class _RawIterable:
    def __init__(self, stream: IterableStream, epoch, shard, num_shards, seed):
        self.stream, self.epoch, self.shard, self.seed = stream, epoch, shard, seed
        self.k, self._it, self._info = 0, None, None
        self._rng = GlobalRng(stream.dataset, always=True)
        ds = stream.dataset
        if hasattr(ds, "set_epoch"):
            call_item(lambda: ds.set_epoch(epoch), f"{stream.name}.set_epoch({epoch})")
        if stream.torch:
            from jtrain.data import torch_adapters

            self._info = torch_adapters.worker_info(ds, shard, num_shards,
                                                    item_seed(seed, epoch, 0, DOMAIN_WORKER, shard))

    @property
    def self_sharded(self) -> bool:
        return self._info is not None and self._info.seen()

    def next(self):
        def draw():
            if self._it is None:
                self._it = iter(self.stream.dataset)
            return next(self._it)

        seed = item_seed(self.seed, self.epoch, self.k, DOMAIN_STREAM, self.shard)
        try:
            if self._info is not None:
                out = self._info.call(lambda: self._rng.call(draw, seed))
            else:
                out = draw()
        except StopIteration:
            raise EpochEnd from None
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"{self.stream.name}[element {self.k} of epoch {self.epoch}]: "
                            f"{type(e).__name__}: {first_line(e)}") from e
        self.k += 1
        return out

    def native_state(self):
        return None

    def restore(self, state) -> None:
        raise NotImplementedError


class ShardStream:
    """One shard's elements, epoch after epoch: (raw item, epoch, element index)."""

    def __init__(self, stream, *, shard: int, num_shards: int, seed: int, holdout=None):
        self.stream, self.shard, self.num_shards, self.seed = stream, shard, num_shards, seed
        self.holdout = holdout  # (fraction, split_seed, keep_held_out) or None
        self.epoch, self._raw = 0, None

    def _open(self, epoch: int):
        self.epoch, self._raw = epoch, self.stream.open(epoch, self.shard, self.num_shards,
                                                        self.seed)

    def next(self):
        if self._raw is None:
            self._open(self.epoch)
        while True:
            k = self._raw.k
            item = self._raw.next()  # EpochEnd propagates
            if self.holdout is not None and _held_out(self.holdout, k) != self.holdout[2]:
                continue
            if self._raw.self_sharded or k % self.num_shards == self.shard:
                return item, k

    def end_epoch(self):
        self._open(self.epoch + 1)

    def state(self) -> dict:
        raw = self._raw
        return {"epoch": self.epoch, "raw": raw.k if raw else 0,
                "native": raw.native_state() if raw else None}

    def restore(self, state: dict) -> None:
        self._open(int(state["epoch"]))
        if state.get("native") is not None:
            self._raw.restore(state["native"])
            self._raw.k = int(state["raw"])
            return
        for _ in range(int(state["raw"])):
            try:
                self._raw.next()
            except EpochEnd:
                raise DataError(f"{self.stream.name}: the stream has fewer elements in epoch "
                                f"{self.epoch} than the checkpoint's position "
                                f"({state['raw']}); it must replay the same elements per "
                                "epoch to resume") from None


def _held_out(holdout, k: int) -> bool:
    fraction, split_seed, _ = holdout
    return item_seed(split_seed, 0, k, DOMAIN_HOLDOUT) / 2.0**63 < fraction


POSITION = "__jtrain_position__"  # rides along with each batch, popped by StreamIterator


class StreamBatches(grain.IterDataset):
    """A grain IterDataset of one process's batches of a stream. grain's mp_prefetch
    gives worker slot j its slice through `set_slice`; slot j reads worker shard
    (j + rotation) mod W, started from `initial[that shard]` (a resumed position)."""

    def __init__(self, stream, *, process_index: int, process_count: int, local_batch: int,
                 seed: int, drop_last: bool, reader: pipeline.BatchReader, holdout=None,
                 num_workers: int = 1, initial=None, rotation: int = 0):
        super().__init__()
        self.stream, self.process_index, self.process_count = stream, process_index, process_count
        self.local_batch, self.seed, self.drop_last = local_batch, seed, drop_last
        self.reader, self.holdout = reader, holdout
        self.num_workers, self.initial, self.rotation = num_workers, initial, rotation
        self.slot = 0

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        self.slot = sl.start or 0

    def __iter__(self):
        return StreamBatchIterator(self)

    def __str__(self) -> str:
        return f"StreamBatches({self.stream!r}, b={self.local_batch})"


class StreamBatchIterator(grain.DatasetIterator):
    def __init__(self, ds: StreamBatches):
        super().__init__()
        self.ds = ds
        self.worker = (ds.slot + ds.rotation) % ds.num_workers
        self.shard = ShardStream(ds.stream, shard=ds.process_index * ds.num_workers + self.worker,
                                 num_shards=ds.process_count * ds.num_workers, seed=ds.seed,
                                 holdout=ds.holdout)
        self.batches_this_epoch = 0
        if ds.initial and ds.initial[self.worker] is not None:
            self.set_state(ds.initial[self.worker])

    def __next__(self) -> dict:
        ds, raws, ks = self.ds, [], []
        while len(raws) < ds.local_batch:
            try:
                item, k = self.shard.next()
            except EpochEnd:
                if raws and not ds.drop_last:
                    break
                if self.batches_this_epoch == 0:
                    raise DataError(_too_short(ds, self.shard, len(raws))) from None
                self.shard.end_epoch()
                self.batches_this_epoch, raws, ks = 0, [], []
                continue
            raws.append(item)
            ks.append(k)
        valid = np.arange(ds.local_batch) < len(raws)
        pad = ds.local_batch - len(raws)
        reader = ds.reader
        batch = pipeline.collate(raws + raws[:1] * pad, ks + ks[:1] * pad, name=reader.name,
                                 collate_fn=reader.collate_fn, ref=reader.ref,
                                 keep_64bit=reader.keep_64bit)
        if reader.mask:
            batch[ROW_MASK] = valid.astype(np.float32)
        self.batches_this_epoch += 1
        if pad:  # the padded batch closed this epoch
            self.shard.end_epoch()
            self.batches_this_epoch = 0
        batch[POSITION] = {"worker": self.worker, "state": self.get_state()}
        return batch

    def get_state(self) -> dict:
        return {**self.shard.state(), "batches_this_epoch": self.batches_this_epoch}

    def set_state(self, state: dict) -> None:
        self.shard.restore(state)
        self.batches_this_epoch = int(state.get("batches_this_epoch", 0))


def _too_short(ds: StreamBatches, shard: ShardStream, got: int) -> str:
    name = ds.reader.name
    where = (f"shard {shard.shard} of {shard.num_shards} (process {ds.process_index}"
             + (f", worker {shard.shard % ds.num_workers}" if ds.num_workers > 1 else "") + ")")
    if got == 0:
        return f"{name}: the stream is empty for {where} in epoch {shard.epoch}"
    return (f"{name}: epoch {shard.epoch} of the stream has {got} examples for {where}, "
            f"fewer than one batch of {ds.local_batch} (data.drop_last drops it)")


class StreamIterator:
    """Endless per-process batches of a stream. The position is every worker shard's
    (epoch, elements drawn) and the number of batches consumed, which says which shard
    comes next (grain takes workers round-robin). It is valid for the same number of
    workers and processes only: they define the shards."""

    def __init__(self, batches: StreamBatches, *, num_workers: int, prefetch: int,
                 worker_init_fn=None):
        self.batches, self.num_workers, self.prefetch = batches, num_workers, prefetch
        self.worker_init_fn, self._it = worker_init_fn, None
        self.consumed, self.shards = 0, [None] * max(1, num_workers)
        # Batches per epoch of this process (all its worker shards), learned when every
        # shard has ended an epoch; None until then (a stream has no length up front).
        self.epoch_batches: int | None = None
        self._epoch_lengths: dict[int, int] = {}

    def _start(self):
        ds = self.batches
        ds.initial, ds.rotation = list(self.shards), self.consumed % len(self.shards)
        self._it = iter(pipeline.with_workers(ds, self.num_workers, self.prefetch,
                                              self.worker_init_fn))

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._it is None:
            self._start()
        batch = next(self._it)
        position = batch.pop(POSITION)
        if self.num_workers:
            batch = pipeline.own_memory(batch)
        worker, state = int(position["worker"]), _jsonable(position["state"])
        if self.epoch_batches is None:
            self._learn_epoch_length(worker, self.shards[worker], state)
        self.shards[worker] = state
        self.consumed += 1
        return batch

    def _learn_epoch_length(self, worker: int, old: dict | None, new: dict) -> None:
        """A shard's epoch ended between its states `old` and `new`: after a padded last
        batch (`new` counts 0 batches in the next epoch) or before a batch that opened
        the next epoch (`new` counts 1); `old` holds the ended epoch's count."""
        if old is None or new["epoch"] != old["epoch"] + 1:
            return
        count = {0: old["batches_this_epoch"] + 1, 1: old["batches_this_epoch"]}.get(
            new["batches_this_epoch"])
        if count:
            self._epoch_lengths[worker] = count
        if len(self._epoch_lengths) == len(self.shards):
            self.epoch_batches = sum(self._epoch_lengths.values())

    def get_state(self) -> dict:
        return {"kind": "stream", "num_workers": self.num_workers,
                "process_count": self.batches.process_count, "consumed": self.consumed,
                "shards": list(self.shards)}

    def set_state(self, state: dict) -> None:
        name = self.batches.reader.name
        if not isinstance(state, dict) or state.get("kind") != "stream":
            raise DataError(f"{name}: the checkpoint's data position is not one of a stream; "
                            "the data changed kind since it was saved (use a new workdir)")
        saved = (state.get("num_workers"), state.get("process_count"))
        if saved != (self.num_workers, self.batches.process_count):
            raise DataError(
                f"data.num_workers: the checkpoint's stream position was saved with "
                f"{saved[0]} worker(s) x {saved[1]} process(es); a stream's shards depend on "
                f"both: resume with data.num_workers={saved[0]} on {saved[1]} process(es)")
        self.close()
        self.consumed, self.shards = int(state["consumed"]), list(state["shards"])

    def close(self) -> None:
        if self._it is not None and hasattr(self._it, "close"):
            self._it.close()
        self._it = None


def _jsonable(tree):
    if isinstance(tree, dict):
        return {str(k): _jsonable(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_jsonable(v) for v in tree]
    if isinstance(tree, np.generic):
        return tree.item()
    if isinstance(tree, bytes):
        return tree.decode()
    return tree


def read_shard(stream, *, shard: int, num_shards: int, seed: int, holdout=None,
               limit: int | None = None) -> list:
    """Epoch 0 of one shard, as a list of raw items (at most `limit`)."""
    s = ShardStream(stream, shard=shard, num_shards=num_shards, seed=seed, holdout=holdout)
    out = []
    while limit is None or len(out) < limit:
        try:
            out.append(s.next()[0])
        except EpochEnd:
            break
    return out
