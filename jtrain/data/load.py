"""What the user gave (or named in the config) -> a `Data`: a map-style source, a stream
or a grain DataLoader, with the collate function and notes that go with it.

Accepted: numpy arrays as `(inputs, targets[, weights])` or a dict of arrays; any
map-style dataset (`len` + `getitem`: a torch Dataset, a grain MapDataset, a list of
items); a torch IterableDataset, a grain IterDataset or any re-iterable object (streams);
a torch DataLoader (its settings are read, see torch_adapters.py); a grain DataLoader;
`jtrain.data.with_transform(dataset, fn)`. A config names a factory by import path,
`data.source="pkg.module:function"`, called with `data.kwargs`; it returns one of the
above, or {"train": ..., "eval": ...}.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import grain
import numpy as np

from jtrain.data import grain_sources, items as items_lib, torch_adapters
from jtrain.data.dataset import Data, LoaderData, MapData, StreamData
from jtrain.data.items import DataError
from jtrain.data.sources import ArraySource, MapSource, WithTransform, call_item, is_array_tree
from jtrain.data.streams import IterableStream
from jtrain.config.named import load_named  # noqa: F401  (data.load_named)


def from_factory(data_cfg) -> tuple[Any, Any]:
    """(train, eval or None) from the factory named by data.source."""
    factory = load_named(data_cfg.source, "data.source")
    if not callable(factory):
        raise DataError("data.source", f"{data_cfg.source} is a {type(factory).__name__}, "
                                       "not a function")
    kwargs = dict(data_cfg.kwargs)
    out = call_item(lambda: factory(**kwargs), f"data.source: {data_cfg.source}(**data.kwargs)")
    if out is None:
        raise DataError("data.source", f"{data_cfg.source} returned None")
    if isinstance(out, dict) and "train" in out and set(out) <= {"train", "eval"}:
        return out["train"], out.get("eval")
    return out, None


def adopt_loader(loader, process_index: int, process_count: int):
    """A torch DataLoader's settings as data.* overrides (batch_size is per process, as in
    torch); the header says so. Returns (what make_sources reads, the overrides)."""
    s = torch_adapters.read_dataloader(loader, "train_data", process_index, process_count)
    overrides = {"batch_size": s.batch_size * process_count, "shuffle": s.shuffle,
                 "drop_last": s.drop_last, "num_workers": s.num_workers}
    if s.prefetch:
        overrides["prefetch"] = int(s.prefetch)
    s.notes.insert(0, f"from a torch DataLoader: batch_size={s.batch_size} per process, "
                      f"shuffle={s.shuffle}, drop_last={s.drop_last}, "
                      f"num_workers={s.num_workers}")
    return s, overrides


def as_data(obj, name: str) -> Data:
    """A `Data` for what the user passed (or a DataError saying what is accepted)."""
    if isinstance(obj, torch_adapters.LoaderSettings):
        data = as_data(obj.dataset, name)
        return dataclasses.replace(data, collate_fn=obj.collate_fn,
                                   worker_init_fn=obj.worker_init_fn,
                                   notes=list(obj.notes) + data.notes)
    if isinstance(obj, WithTransform):
        return add_transform(as_data(obj.dataset, name), obj.fn)
    if torch_adapters.is_dataloader(obj):
        return as_data(torch_adapters.read_dataloader(obj, name, 0, 1), name)
    if isinstance(obj, np.ndarray):
        raise DataError(name, "a bare array has no targets; pass (inputs, targets) or a "
                              "dict with 'inputs' and 'targets'")
    if isinstance(obj, tuple) and len(obj) in (2, 3) and all(hasattr(a, "shape") for a in obj):
        obj = dict(zip(items_lib.TUPLE_KEYS, obj, strict=False))  # 2 or 3 of the 3 keys
    if isinstance(obj, dict) and obj and all(is_array_tree(v) for v in obj.values()):
        return MapData(name, ArraySource(obj, name), "arrays")
    if grain_sources.is_grain_loader(obj):
        return LoaderData(name, obj, "grain DataLoader")
    if isinstance(obj, grain.IterDataset):
        return StreamData(name, grain_sources.GrainStream(obj, name), "grain IterDataset")
    if isinstance(obj, grain.MapDataset):
        return MapData(name, MapSource(obj, name), "grain MapDataset")
    kind = type(obj).__name__
    if torch_adapters.is_iterable_dataset(obj):
        return _stream(obj, name, f"torch {kind} (stream)")
    if hasattr(obj, "__getitem__") and hasattr(obj, "__len__") and \
            not isinstance(obj, (str, bytes, dict)):
        return MapData(name, MapSource(obj, name),
                    ("torch " if type(obj).__module__.startswith("torch") or
                     _is_torch(obj) else "") + kind)
    if hasattr(obj, "__iter__") and not isinstance(obj, (str, bytes, dict)):
        return _stream(obj, name, f"{kind} (stream)")
    raise DataError(name, f"unsupported data of type {kind}; pass arrays, a dict of arrays, "
                          "a map-style dataset (len + getitem), a torch IterableDataset or "
                          "DataLoader, or a grain dataset")


def add_transform(data: Data, fn: Callable) -> Data:
    """`fn(item, rng)` on every item read, rng from (seed, epoch, index)."""
    if not callable(fn):
        raise DataError(data.name, f"a transform must be callable, got {type(fn).__name__}")
    return data.with_transform(fn)


def _is_torch(obj) -> bool:
    return any(c.__module__.startswith("torch.utils.data") for c in type(obj).__mro__[1:])


def _stream(obj, name: str, description: str) -> Data:
    stream = IterableStream(obj, name)
    return StreamData(name, stream, description, count=stream.declared_len())
