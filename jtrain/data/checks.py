"""The checks before training: bad data fails here, in one line naming the dataset and
the item or field, not at step 1000 (and never as a zero-step "success" or a hang).

Map-style: empty, fewer examples than one global batch, a `__len__` that lies (the last
index does not read), items whose fields, shapes or dtypes differ (items 0, 1, N/4, N/2,
3N/4 and N-1 are compared; every other item is compared when its batch is made, and
named by index then). Streams: empty, fewer examples than one batch, items that differ
within the first batch. With a collate_fn, its output on the first and the last examples
must agree. `check` returns a checked copy of the `Data` carrying `ref` (the signature
every batch must match) and `sample` (a batch, for shapes); the input is left as it was.
"""

from __future__ import annotations

import dataclasses

from jtrain.data import grain_sources, items as items_lib, pipeline, streams
from jtrain.data.items import DataError
from jtrain.data.dataset import Data, ListData, LoaderData, MapData, StreamData


def check(data: Data, *, global_batch: int, process_index: int = 0, process_count: int = 1,
          drop_last: bool = True, train: bool = True) -> Data:
    """`data` checked: a copy with `ref` and `sample` (itself if already checked)."""
    if data.ref is not None:
        return data
    local_batch = max(1, global_batch // process_count)
    check_kind = _CHECKS[type(data)]
    ref, sample = check_kind(data, global_batch=global_batch, local_batch=local_batch,
                             p=process_index, num=process_count, train=train,
                             need_full=drop_last and train)
    return dataclasses.replace(data, ref=ref, sample=sample, notes=list(data.notes))


def _len(data: Data) -> int:
    try:
        return int(len(data.source))
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"{data.name}: len() of the dataset failed: {type(e).__name__}: "
                        f"{items_lib.first_line(e)}") from None


def _check_map(data: Data, *, global_batch: int, local_batch: int, train: bool, **_) -> tuple:
    src, name = data.source, data.name
    n = _len(data)
    if n == 0:
        raise DataError(f"{name}: the dataset is empty")
    if train and n < global_batch:
        raise DataError(f"{name}: {n} examples is fewer than one global batch "
                        f"(data.batch_size={global_batch})")
    probe = sorted({0, 1, n // 4, n // 2, 3 * n // 4, n - 1} & set(range(n)))
    raws = {i: _read(src, i, n, name) for i in probe}
    keep64 = items_lib.x64_enabled()
    if data.collate_fn is None:
        ref = items_lib.signature(items_lib.to_numpy_item(raws[0], f"{name}[0]", keep64))
        for i in probe[1:]:
            item = items_lib.to_numpy_item(raws[i], f"{name}[{i}]", keep64)
            why = items_lib.mismatch(ref, items_lib.signature(item), "item 0")
            if why:
                raise DataError(f"{name}[{i}]{why}")
    k = min(local_batch, n)
    ref, sample = pipeline.reference(
        src, name=name, collate_fn=data.collate_fn, sample=k, keep_64bit=keep64,
        read=lambda i: raws[i] if i in raws else src.read(i))
    if data.collate_fn is not None and n > k:  # the collate_fn's output on the last items
        last = list(range(n - k, n))
        pipeline.collate([src.read(i) for i in last], last, name=name,
                         collate_fn=data.collate_fn, ref=ref, keep_64bit=keep64)
    return ref, sample


def _read(src, i: int, n: int, name: str):
    try:
        return src.check_read(i)
    except DataError as e:
        cause = e.__cause__
        if isinstance(cause, (IndexError, KeyError)) and i >= 1:
            raise DataError(f"{name}: __len__ says {n} but item {i} raises "
                            f"{type(cause).__name__}: {items_lib.first_line(cause)}") from cause
        raise


def _check_stream(data: Data, *, local_batch: int, p: int, num: int, need_full: bool,
                  **_) -> tuple:
    name = data.name
    raws = streams.read_shard(data.source, shard=p, num_shards=num, seed=0,
                              holdout=data.holdout, limit=local_batch)
    where = f" for process {p} of {num}" if num > 1 else ""
    if not raws:
        raise DataError(f"{name}: the stream is empty{where}")
    if need_full and len(raws) < local_batch:
        raise DataError(f"{name}: the stream has {len(raws)} examples{where}, fewer than one "
                        f"batch of {local_batch} (data.batch_size / processes; data.drop_last "
                        "drops it)")
    keep64 = items_lib.x64_enabled()
    if data.collate_fn is None:
        ref = items_lib.signature(items_lib.to_numpy_item(raws[0], f"{name}[0]", keep64))
        for i, raw in enumerate(raws[1:], 1):
            item = items_lib.to_numpy_item(raw, f"{name}[{i}]", keep64)
            why = items_lib.mismatch(ref, items_lib.signature(item), "item 0")
            if why:
                raise DataError(f"{name}[{i}]{why}")
    return pipeline.reference(
        data.source, name=name, collate_fn=data.collate_fn, sample=len(raws),
        keep_64bit=keep64, read=lambda i: raws[i])


def _check_loader(data: Data, *, local_batch: int, p: int, num: int, **_) -> tuple:
    name = data.name
    grain_sources.check_loader_sharding(data.source, name, p, num)
    it = grain_sources.LoaderIterator(data.source, name=name, local_batch=local_batch,
                                      keep_64bit=items_lib.x64_enabled())
    try:
        batch = next(it)
    except DataError as e:
        if "leading dim" in str(e):
            raise DataError(f"{name}: the grain DataLoader's batches do not have "
                            f"data.batch_size / processes = {local_batch} rows ({e})") from None
        raise
    return items_lib.signature(batch, batched=True), batch


# The check of each kind (an explicit table, as for models and optimizers).
_CHECKS = {MapData: _check_map, ListData: _check_map, StreamData: _check_stream,
           LoaderData: _check_loader}


def batches_per_epoch(data: Data, global_batch: int, drop_last: bool) -> int | None:
    """Exact for map-style data; from a declared length for streams; else None."""
    n = data.known_size
    if not n:
        return None
    return n // global_batch if drop_last else -(-n // global_batch)
