"""Everything between a user's dataset and per-process numpy batches. Reads `config.data`.

Yields numpy only and knows nothing about devices: `jtrain.mesh.host_to_device` turns a
per-process batch into a global sharded array, in one place.

Items are dicts of numpy arrays with the engine's keys (`inputs`, `targets`, optional
`weights`); a `(x, y)` tuple item means `{"inputs": x, "targets": y}`. Torch tensors
become numpy inside the pipeline.
"""

from __future__ import annotations

import numbers
from typing import Any, Iterator

import grain
import numpy as np

from jtrain.data import text


class DataError(ValueError):
    """Bad input data; str(e) names the dataset and the item or field."""


BUILTIN = {"pystdlib": text.make_pystdlib}


def make_sources(data_cfg, train_data=None, eval_data=None):
    """(train source, eval source or None, info dict) from config or user data."""
    if train_data is None:
        if data_cfg.name not in BUILTIN:
            raise DataError(f"data.name: unknown dataset {data_cfg.name!r}; built-in: "
                            f"{', '.join(BUILTIN)}")
        try:
            train, val, info = BUILTIN[data_cfg.name](data_cfg.seq_len, data_cfg.val_fraction)
        except text.CorpusError as e:
            raise DataError(str(e)) from None
        if eval_data is not None:
            val = as_source(eval_data, "eval_data")
        return train, val, info
    train = as_source(train_data, "train_data")
    val = as_source(eval_data, "eval_data") if eval_data is not None else None
    return train, val, {"name": type(train_data).__name__, "num_examples": len(train)}


def as_source(data, name: str):
    """A map-style source (len + getitem -> dict of numpy) from what the user gave."""
    if isinstance(data, np.ndarray):
        raise DataError(f"{name}: a bare array has no targets; pass (inputs, targets) or a "
                        "dict with 'inputs' and 'targets'")
    if isinstance(data, tuple) and len(data) == 2 and all(hasattr(a, "shape") for a in data):
        data = {"inputs": data[0], "targets": data[1]}
    if isinstance(data, dict):
        return ArraySource(data, name)
    if hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        return MapSource(data, name)
    raise DataError(f"{name}: unsupported data of type {type(data).__name__}; pass arrays, "
                    "a dict of arrays, or a map-style dataset (len + getitem)")


class ArraySource:
    """Rows of a dict of equally long arrays."""

    def __init__(self, arrays: dict, name: str):
        if "inputs" not in arrays:
            raise DataError(f"{name}: missing the 'inputs' field (got {sorted(arrays)})")
        self._arrays = {k: np.asarray(v) for k, v in arrays.items()}
        lengths = {k: len(v) for k, v in self._arrays.items()}
        if len(set(lengths.values())) != 1:
            raise DataError(f"{name}: fields have different lengths {lengths}")
        self._len, self._name = next(iter(lengths.values())), name

    def __len__(self):
        return self._len

    def __getitem__(self, i):
        return {k: v[i] for k, v in self._arrays.items()}

    def __repr__(self):
        shapes = {k: v.shape for k, v in self._arrays.items()}
        return f"ArraySource({self._name}, {shapes})"


class MapSource:
    """Any map-style dataset (a torch Dataset included); items become dicts of numpy."""

    def __init__(self, dataset, name: str):
        self._ds, self._name = dataset, name

    def __len__(self):
        return len(self._ds)

    def __getitem__(self, i):
        return to_numpy_item(self._ds[i], f"{self._name}[{i}]")

    def __repr__(self):
        return f"MapSource({self._name}, {type(self._ds).__name__}, n={len(self)})"


def to_numpy_item(item, where: str) -> dict:
    if isinstance(item, (tuple, list)):
        if len(item) != 2:
            raise DataError(f"{where}: a tuple item must be (inputs, targets), got "
                            f"{len(item)} elements")
        item = {"inputs": item[0], "targets": item[1]}
    if not isinstance(item, dict):
        raise DataError(f"{where}: items must be dicts or (inputs, targets) tuples, got "
                        f"{type(item).__name__}")
    return {k: _to_numpy(v, f"{where}.{k}") for k, v in item.items()}


def _to_numpy(value, where: str) -> np.ndarray:
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor
        return value.detach().cpu().numpy()
    if isinstance(value, (np.ndarray, np.generic)):
        return np.asarray(value)
    if isinstance(value, numbers.Number):
        return np.asarray(value)
    try:
        return np.asarray(value)
    except Exception as e:
        raise DataError(f"{where}: cannot convert {type(value).__name__} to an array: {e}") \
            from None


def check_source(source, *, global_batch: int, name: str) -> None:
    """Fail before training on sources that would give zero or ragged batches."""
    n = len(source)
    if n == 0:
        raise DataError(f"{name}: the dataset is empty")
    if n < global_batch:
        raise DataError(f"{name}: {n} examples is fewer than one global batch "
                        f"(data.batch_size={global_batch})")
    first = source[0]
    for i in sorted({1, n // 2, n - 1} - {0}):
        item = source[i]
        if sorted(item) != sorted(first):
            raise DataError(f"{name}[{i}]: fields {sorted(item)} differ from item 0's "
                            f"{sorted(first)}")
        for k in first:
            a, b = np.asarray(first[k]), np.asarray(item[k])
            if a.shape != b.shape or a.dtype != b.dtype:
                raise DataError(f"{name}[{i}].{k}: shape/dtype {b.shape} {b.dtype} differs "
                                f"from item 0's {a.shape} {a.dtype}")


def make_train_iterator(source, *, local_batch: int, seed: int, shuffle: bool,
                        process_index: int, process_count: int, num_workers: int = 0):
    """An endless iterator of per-process batches with `get_state()`/`set_state()`.

    Each epoch is reshuffled from (seed, epoch); process p reads every P-th example of
    the global order, so processes read disjoint shards."""
    ds = grain.MapDataset.source(source)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(None)[process_index::process_count]
    ds = ds.batch(local_batch, drop_remainder=True)
    it_ds = ds.to_iter_dataset()
    if num_workers > 0:
        it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
    return iter(it_ds)


def eval_batches(source, *, local_batch: int, process_index: int, process_count: int,
                 max_batches: int = 0) -> Iterator[dict[str, Any]]:
    """Every example exactly once, in order, in padded batches with a `mask` [b].

    Global batch g holds examples [g*B, (g+1)*B); process p takes its b = B/P rows of it.
    The last batch is padded with copies of example 0 and mask 0, so all processes run
    the same number of steps and the step compiles once."""
    n = len(source)
    global_batch = local_batch * process_count
    num = -(-n // global_batch)
    if max_batches:
        num = min(num, max_batches)
    pad_item = source[0]
    for g in range(num):
        start = g * global_batch + process_index * local_batch
        rows, mask = [], np.zeros(local_batch, np.float32)
        for j in range(local_batch):
            if start + j < n:
                rows.append(source[start + j])
                mask[j] = 1.0
            else:
                rows.append(pad_item)
        batch = {k: np.stack([np.asarray(r[k]) for r in rows]) for k in pad_item}
        batch["mask"] = mask
        yield batch


def num_eval_examples(source, max_batches: int, global_batch: int) -> int:
    n = len(source)
    return min(n, max_batches * global_batch) if max_batches else n
