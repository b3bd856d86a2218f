"""The checks before training: bad data fails here, in one line naming the dataset and
the item or field, not at step 1000 (and never as a zero-step "success" or a hang).

Map-style: empty, fewer examples than one global batch, a `__len__` that lies (the last
index does not read), items whose fields, shapes or dtypes differ (items 0, 1, N/4, N/2,
3N/4 and N-1 are compared; every other item is compared when its batch is made, and
named by index then). Streams: empty, fewer examples than one batch, items that differ
within the first batch. With a collate_fn, its output on the first and the last examples
must agree. `check` returns a checked copy of the `Data` carrying `ref` (the signature
every batch must match) and `sample` (a batch, for shapes); the input is left as it was.

Once the model's output shape is known (`jtrain.engine.checks.check_targets`), the first
batches of each split against it: targets the default loss would score wrong or fail
on, class labels out of range (every example of in-memory arrays, else the first
LABEL_SCAN), and NaN / inf (`check_finite` gives the policy).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jtrain.data import items as items_lib, pipeline
from jtrain.data.items import DataError
from jtrain.losses import ROW_MASK
from jtrain.data.dataset import Data, ListData, LoaderData, MapData, StreamData
from jtrain.data.sources import ArraySource, Subset


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
    raws = data.local_rows(p, num, workers=1, limit=local_batch)  # shard p of num
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
    try:
        batch = data.first_batch(local_batch, p, num)
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


# ---------------------------------------------------------------------------------------
# The first batches against the model and the loss (called by jtrain.engine.checks.
# check_targets once the model's output shape is known; numpy only).

LABEL_SCAN = 256  # examples whose labels are read one by one (arrays: every example)
FULL_SCAN = 1 << 26  # label arrays up to this many elements are checked whole


def first_batch(data: Data) -> dict:
    """The checked sample batch: the first examples, in order."""
    if data.sample is not None:
        return data.sample
    return items_lib.tree_map(lambda x: np.asarray(x)[None], data[0])


def column(data: Data, field: str) -> np.ndarray | None:
    """Every example's `field` as one array when that reads nothing: in-memory arrays
    (or a split of them) without a transform or collate_fn, of at most FULL_SCAN
    elements (else the first LABEL_SCAN examples); else None."""
    src, rows = data.source, None
    if data.collate_fn is not None:
        return None
    if isinstance(src, Subset):
        src, rows = src.source, src.indices
    if not isinstance(src, ArraySource) or isinstance(src.arrays.get(field), (dict, type(None))):
        return None
    values = src.arrays[field]
    n = len(values) if rows is None else len(rows)
    if values.size // max(len(values), 1) * n > FULL_SCAN:
        n = LABEL_SCAN
    return values[:n] if rows is None else values[rows[:n]]


def _shape(shape) -> str:
    return str(tuple(shape))


def check_default_loss_targets(data: Data, output_shape: tuple) -> None:
    """Targets the default loss (cross-entropy for integers, MSE for floats) would score
    wrong or fail on at step 1, against one example's output shape."""
    name, example, out = data.name, data[0], tuple(output_shape)
    if "targets" not in example:
        return  # said by the caller: the default loss needs a 'targets' field
    targets = example["targets"]
    if isinstance(targets, (dict, list, tuple)):
        fields = ", ".join(p.lstrip(".") for p, _ in items_lib.flatten(targets)) or "none"
        raise DataError(f"{name}: targets is a {type(targets).__name__} ({fields}); the "
                        "default loss scores one array against the model's output: pass "
                        "loss_fn(outputs, batch), or set loss.fn or loss.terms")
    t = np.asarray(targets)
    shape, kind = tuple(t.shape), t.dtype.kind
    classes = out[-1] if out and out[:-1] == shape else None  # outputs = targets + (C,)
    if kind == "b":
        cast = (f"np.int32 for a {classes}-class cross-entropy" if classes and classes >= 2
                else "np.float32 for a regression (MSE)")
        raise DataError(f"{name}: targets are bool (shape {_shape(shape)} per example); the "
                        "default loss takes integer class labels or float values: cast "
                        f"them to {cast}, or pass a loss_fn")
    if kind in "iu":
        if classes is None:
            regress = ("; for a regression, cast the targets to np.float32"
                       if out == shape else "")
            raise DataError(
                f"{name}: integer targets (class labels) of shape {_shape(shape)} per example "
                f"need model outputs of shape {_shape(shape)} + (classes,), got "
                f"{_shape(out)}; fix the targets or the model's output, or pass a loss_fn"
                + regress)
        if classes < 2:
            raise DataError(
                f"{name}: integer targets (class labels) against 1 model output per "
                f"{'example' if not shape else 'position'}: cross-entropy over a single "
                "class is 0 whatever the model does, so nothing would train; give the "
                "model one output per class (2 for labels 0/1), cast the targets to "
                "np.float32 for a regression, or pass a loss_fn (e.g. jtrain.losses."
                "binary_cross_entropy)")
    elif kind == "f":
        batch_targets = np.asarray(first_batch(data)["targets"])
        if shape != out:
            if classes and classes >= 2 and _holds_labels(batch_targets, classes):
                seen = ", ".join(str(float(v)) for v in np.unique(batch_targets)[:3])
                raise DataError(
                    f"{name}: float targets that hold class labels ({seen}, ...) against "
                    f"{classes} model outputs per example: the default loss fits float "
                    "targets by MSE; cast them to np.int32 for cross-entropy, or pass a "
                    "loss_fn")
            raise DataError(
                f"{name}: targets of shape {_shape(shape)} per example against model "
                f"outputs of shape {_shape(out)}: the default MSE would broadcast them; "
                "reshape the targets (or the output) to match, or pass a loss_fn")
        if out and out[-1] >= 2 and _one_hot(batch_targets):
            raise DataError(
                f"{name}: targets are one-hot rows of {out[-1]} (float): the default loss "
                "would fit them by MSE, as a regression; pass class indices "
                "(np.argmax(targets, -1).astype(np.int32)) for cross-entropy, or a loss_fn")


def check_weights(data: Data) -> None:
    """The default loss weighs each target by `weights` (e.g. a loss mask): one weight per
    example, or per leading target position ([B, T] weights for [B, T] labels)."""
    batch = first_batch(data)
    t, w = batch.get("targets"), batch.get("weights")
    if w is None or t is None or isinstance(t, (dict, list, tuple)) or \
            isinstance(w, (dict, list, tuple)):
        return
    ws, ts = tuple(np.shape(w)[1:]), tuple(np.shape(t)[1:])
    if ws != ts[:len(ws)]:
        raise DataError(
            f"{data.name}: weights of shape {_shape(ws)} per example against targets of "
            f"shape {_shape(ts)}: the default loss takes one weight per example (shape ()) "
            "or per leading target position; reshape the weights, or pass a loss_fn")


def _holds_labels(values: np.ndarray, classes: int) -> bool:
    finite = values[np.isfinite(values)]
    return bool(finite.size) and bool(np.all((finite == np.round(finite)) & (finite >= 0)
                                             & (finite < classes)))


def _one_hot(values: np.ndarray) -> bool:
    return values.size > 0 and bool(np.all((values == 0) | (values == 1))) and \
        bool(np.all(values.sum(axis=-1) == 1))


def check_labels(data: Data, num_classes: int, *, low: float = 0) -> None:
    """Class labels in [low, num_classes) (low = -inf: negative labels are an ignore
    index) in the first batch, then up to LABEL_SCAN examples of map-style data, or every
    example of in-memory arrays; a label whose weight is 0 is never used."""
    name = data.name
    labels = column(data, "targets")
    if labels is not None and "weights" in data[0] and column(data, "weights") is None:
        labels = None  # weights from elsewhere: read example by example
    if labels is not None:
        blocks = [(0, labels, column(data, "weights"))]
    else:
        batch = first_batch(data)
        blocks = [(0, batch.get("targets"), batch.get("weights"))]
        if isinstance(data, MapData):
            start = len(blocks[0][1]) if blocks[0][1] is not None else 0
            blocks += [(i, *_one_example(data[i])) for i in range(
                start, min(len(data), LABEL_SCAN))]
    for start, targets, weights in blocks:
        if targets is None or isinstance(targets, (dict, list, tuple)):
            return
        t = np.asarray(targets)
        if t.dtype.kind not in "iu":
            return
        bad = (t < low) | (t >= num_classes)
        w = None if weights is None else np.asarray(weights)
        if w is not None and w.shape == t.shape[:w.ndim]:  # weight 0: never used
            bad &= np.broadcast_to((w > 0).reshape(w.shape + (1,) * (t.ndim - w.ndim)),
                                   t.shape)
        if bad.any():
            row = int(np.argwhere(bad)[0][0])
            value = int(t[bad].flat[0])
            one_based = ("; they look 1-based (no label 0 among them): subtract 1"
                         if value == num_classes and not (t == 0).any() else "")
            raise DataError(
                f"{name}: example {start + row} has class label {value}, outside "
                f"0..{num_classes - 1} (the model has {num_classes} outputs); fix the "
                "labels, give the model more outputs, or give such labels weight 0 "
                f"(batch['weights']){one_based}")


def _one_example(example: dict) -> tuple:
    """(targets, weights) of one example with a leading axis of 1."""
    t, w = example.get("targets"), example.get("weights")
    if t is None or isinstance(t, (dict, list, tuple)):
        return None, None
    return np.asarray(t)[None], None if w is None else np.asarray(w)[None]


def _weighted_only(targets: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The targets with weight-0 elements zeroed: a NaN there is a missing value that
    the losses and metrics select out (as `jtrain.step.row_validity` does)."""
    try:
        w = np.broadcast_to(
            weights.reshape(weights.shape + (1,) * (targets.ndim - weights.ndim)), targets.shape)
    except ValueError:  # a weights shape that does not fit: the shape check says so
        return targets
    return np.where(w != 0, targets, 0)


def check_finite(data: Data, *, train: bool) -> None:
    """NaN / inf in the first batch's floating fields. Training skips a batch with such
    an example (`jtrain.step.row_validity`, logged in WORKDIR/skipped.jsonl), so the
    train split fails only when every example of its first batch has one (nothing would
    train); eval skips nothing (every metric would be NaN), so one is enough there."""
    batch = {k: v for k, v in first_batch(data).items() if k != ROW_MASK}
    rows, fields = None, []
    for path, leaf in items_lib.flatten(batch):
        x = np.asarray(leaf)
        if x.dtype.kind not in "fc" or x.ndim == 0:
            continue
        if path.lstrip(".") == "targets" and "weights" in batch:
            x = _weighted_only(x, np.asarray(batch["weights"]))
        bad = ~np.isfinite(x).reshape(len(x), -1).all(axis=1)  # [rows]
        if bad.any():
            fields.append((path.lstrip("."), bad, x))
            rows = bad if rows is None else rows | bad
    if rows is None:
        return
    path, bad, x = fields[0]
    i = int(np.argmax(bad))
    value = x[i][~np.isfinite(x[i])].flat[0]
    n = len(rows)
    if not train:
        raise DataError(
            f"{data.name}: example {i} has {value} in {path} ({int(rows.sum())} of the "
            f"first {n} eval examples hold NaN or inf); eval skips no example, so every "
            "eval metric would be NaN: replace them, or drop such examples")
    if rows.all():
        by_field = ", ".join(f"{p}: {int(b.sum())} of {n}" for p, b, _ in fields)
        raise DataError(
            f"{data.name}: all {n} examples of the first batch hold NaN or inf ({by_field}; "
            f"example {i} has {value} in {path}); training skips every batch holding one, so "
            "nothing would train: replace them (impute missing values; give missing "
            "targets weight 0), or drop such examples")
