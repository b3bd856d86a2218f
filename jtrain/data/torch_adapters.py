"""PyTorch objects as jtrain data: a `torch.utils.data.DataLoader` read setting by
setting, and the `get_worker_info()` a torch IterableDataset splits itself by.

Nothing here imports torch at module level: a user who passes a torch object has already
imported it, and jtrain runs without torch otherwise.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable

from jtrain import internals
from jtrain.errors import DataError


def _torch():
    return sys.modules.get("torch")


def is_dataloader(obj) -> bool:
    torch = _torch()
    return torch is not None and isinstance(obj, torch.utils.data.DataLoader)


def is_iterable_dataset(obj) -> bool:
    torch = _torch()
    return torch is not None and isinstance(obj, torch.utils.data.IterableDataset)


def is_default_collate(fn) -> bool:
    """torch's default_collate stacks like jtrain's numpy collate: use ours (no tensors)."""
    torch = _torch()
    if torch is None or fn is None:
        return fn is None
    return fn is torch.utils.data.default_collate


@dataclasses.dataclass
class LoaderSettings:
    """What jtrain takes from a DataLoader (batch_size is per process, as in torch)."""
    dataset: Any
    batch_size: int
    shuffle: bool
    drop_last: bool
    num_workers: int
    prefetch: int | None
    collate_fn: Callable | None
    worker_init_fn: Callable | None
    notes: list


def read_dataloader(loader, name: str, process_index: int, process_count: int) -> LoaderSettings:
    """The loader's settings, or a one-line DataError naming the one jtrain cannot honour."""
    from torch.utils import data as tud

    if loader.batch_size is None:
        raise DataError(f"{name}: a DataLoader with batch_size=None or a batch_sampler cannot "
                        "be honoured: jtrain batches by data.batch_size; pass batch_size=N")
    sampler, notes = loader.sampler, []
    iterable = is_iterable_dataset(loader.dataset)
    if iterable:
        shuffle = False
    elif type(sampler) is tud.SequentialSampler:
        shuffle = False
    elif type(sampler) is tud.RandomSampler:
        if sampler.replacement or sampler.num_samples != len(loader.dataset):
            raise DataError(f"{name}: a RandomSampler with replacement or num_samples cannot be "
                            "honoured: jtrain reads each example once per epoch")
        shuffle = True
        notes.append("shuffled per epoch from (seed, epoch)")
    elif isinstance(sampler, tud.DistributedSampler):
        if (sampler.num_replicas, sampler.rank) != (process_count, process_index):
            raise DataError(
                f"{name}: DistributedSampler(num_replicas={sampler.num_replicas}, "
                f"rank={sampler.rank}) does not match this run's process {process_index} of "
                f"{process_count}; jtrain shards by process itself: drop the sampler")
        shuffle = sampler.shuffle
        notes.append("DistributedSampler: jtrain shards by process and reshuffles per epoch")
    else:
        raise DataError(f"{name}: sampler {type(sampler).__name__} cannot be honoured: jtrain "
                        "reads every example once per epoch, shuffled or in order; pass "
                        "shuffle=True/False (or select examples with torch.utils.data.Subset)")
    collate = None if is_default_collate(loader.collate_fn) else loader.collate_fn
    if collate is not None:
        notes.append(f"collate_fn {getattr(collate, '__name__', type(collate).__name__)}")
    init = loader.worker_init_fn
    return LoaderSettings(
        dataset=loader.dataset, batch_size=int(loader.batch_size), shuffle=shuffle,
        drop_last=bool(loader.drop_last), num_workers=int(loader.num_workers),
        prefetch=loader.prefetch_factor if loader.num_workers else None,
        collate_fn=collate, worker_init_fn=(lambda i, n: init(i)) if init else None,
        notes=notes)


class _WorkerInfo:
    """A torch WorkerInfo for shard `id` of `num_workers`, set while a stream is read,
    that records whether the dataset looked at it (then it splits itself)."""

    def __init__(self, dataset, shard: int, num_shards: int, seed: int):
        self._seen = [False]
        seen = self._seen

        class Watched(internals.torch_worker_info_class()):
            def __getattribute__(self, attr):
                if attr in ("id", "num_workers"):
                    seen[0] = True
                return super().__getattribute__(attr)

        self.info = Watched(id=shard, num_workers=num_shards, seed=seed, dataset=dataset)

    def seen(self) -> bool:
        return self._seen[0]

    def call(self, fn: Callable):
        return internals.torch_with_worker_info(self.info, fn)


def worker_info(dataset, shard: int, num_shards: int, seed: int) -> _WorkerInfo:
    return _WorkerInfo(dataset, shard, num_shards, seed)
