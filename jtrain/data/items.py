"""Items and batches: what a user's dataset returns, made into dicts of numpy arrays.

An item is a dict with `inputs` (an array or a nested dict/list/tuple of arrays),
`targets` and optional `weights`, or a tuple `(inputs, targets[, weights])`; a dict
without `inputs` is given to the model whole (or the fields `data.model_inputs` names,
`jtrain.step.inputs_of`), and `loss_fn(outputs, batch)` sees every field. Leaves may
be torch tensors, numpy arrays or Python numbers. They become numpy here, in the process
that read them, before anything crosses a worker process (torch tensors through grain
workers crash on the second batch). 64-bit leaves become 32-bit, as JAX would make them
on the device anyway (half the bytes to copy), unless JAX runs with x64 enabled.

Every error is a `DataError` naming the dataset and the item index and field:
`train_data[17].inputs: shape (3, 5) differs from item 0's (3, 4)`.
"""

from __future__ import annotations

import numbers
import sys
from typing import Any, Callable, Sequence

import numpy as np


from jtrain.errors import DataError, first_line  # noqa: F401  (used across jtrain.data)
from jtrain.losses import ROW_MASK


TUPLE_KEYS = ("inputs", "targets", "weights")
_NARROW = {np.dtype(np.int64): np.int32, np.dtype(np.uint64): np.uint32,
           np.dtype(np.float64): np.float32, np.dtype(np.complex128): np.complex64}


def x64_enabled() -> bool:
    jax = sys.modules.get("jax")  # the data layer never imports JAX itself
    return bool(jax is not None and jax.config.read("jax_enable_x64"))


def is_torch_tensor(value) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")


def as_dict(raw, where: str) -> dict:
    """The engine's dict form of one raw item (or of one collated batch)."""
    if isinstance(raw, (tuple, list)):
        if len(raw) not in (2, 3):
            raise DataError(f"{where}: a tuple item must be (inputs, targets) or (inputs, "
                            f"targets, weights), got {len(raw)} elements")
        return dict(zip(TUPLE_KEYS, raw, strict=False))  # 2 or 3 of the 3 keys
    if isinstance(raw, dict):
        if not raw:
            raise DataError(f"{where}: an empty dict item; items need fields such as "
                            "'inputs' and 'targets'")
        if ROW_MASK in raw:
            raise DataError(f"{where}: the field {ROW_MASK!r} is the engine's row mask; "
                            "rename it")
        return raw
    raise DataError(f"{where}: items must be dicts or (inputs, targets) tuples, got "
                    f"{type(raw).__name__}")


def to_numpy_item(raw, where: str, keep_64bit: bool = False) -> dict:
    """One raw item -> {"inputs": ..., "targets": ..., ...} of numpy leaves."""
    return {k: _convert(v, f"{where}.{k}", keep_64bit) for k, v in as_dict(raw, where).items()}


def _convert(value, where: str, keep_64bit: bool):
    if isinstance(value, dict):
        return {k: _convert(v, f"{where}.{k}", keep_64bit) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and value and not isinstance(value[0], numbers.Number):
        return type(value)(_convert(v, f"{where}[{i}]", keep_64bit) for i, v in enumerate(value))
    if is_torch_tensor(value):
        value = value.detach().cpu()
        try:
            arr = value.numpy()
        except TypeError:  # bfloat16 and friends have no numpy dtype
            arr = value.float().numpy()
    else:
        try:
            arr = np.asarray(value)
        except Exception as e:
            raise DataError(f"{where}: cannot make an array of {type(value).__name__}: {e}") \
                from None
    if arr.dtype.kind not in "biufc":
        raise DataError(f"{where}: {arr.dtype} values ({type(value).__name__}) cannot go to "
                        "a device; items must hold numbers")
    if not keep_64bit and arr.dtype in _NARROW:
        arr = arr.astype(_NARROW[arr.dtype])
    return arr


def flatten(tree, prefix: str = "") -> list[tuple[str, Any]]:
    """[(".inputs.image", leaf), ...] in a fixed order (dict keys sorted)."""
    if isinstance(tree, dict):
        return [p for k in sorted(tree, key=str) for p in flatten(tree[k], f"{prefix}.{k}")]
    if isinstance(tree, (list, tuple)):
        return [p for i, v in enumerate(tree) for p in flatten(v, f"{prefix}[{i}]")]
    return [(prefix, tree)]


def tree_map(fn: Callable, *trees):
    first = trees[0]
    if isinstance(first, dict):
        return {k: tree_map(fn, *(t[k] for t in trees)) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(tree_map(fn, *xs) for xs in zip(*trees, strict=True))
    return fn(*trees)


def signature(tree, batched: bool = False) -> dict[str, tuple[tuple, str]]:
    """{field path: (shape, dtype)}; without the leading batch dim if `batched`."""
    return {p: (tuple(np.shape(x))[1 if batched else 0:], str(np.asarray(x).dtype))
            for p, x in flatten(tree)}


def mismatch(ref: dict, sig: dict, ref_name: str) -> str | None:
    """Why `sig` differs from `ref` (field + what), or None."""
    if list(ref) != list(sig):
        missing, extra = sorted(set(ref) - set(sig)), sorted(set(sig) - set(ref))
        what = (f"lacks {', '.join(k.lstrip('.') for k in missing)}" if missing else
                f"has extra {', '.join(k.lstrip('.') for k in extra)}")
        return f": fields {[k.lstrip('.') for k in sig]} differ from {ref_name}'s ({what})"
    for path in ref:
        (s0, d0), (s1, d1) = ref[path], sig[path]
        if s0 != s1:
            return f"{path}: shape {s1} differs from {ref_name}'s {s0}"
        if d0 != d1:
            return f"{path}: dtype {d1} differs from {ref_name}'s {d0}"
    return None


def stack(items: Sequence[dict], indices: Sequence[int], name: str, ref: dict) -> dict:
    """The default collate: numpy items -> a batch, each item checked against `ref`
    (item 0's signature) so that a bad item is named by its index."""
    for item, i in zip(items, indices, strict=True):
        why = mismatch(ref, signature(item), "item 0")
        if why:
            raise DataError(f"{name}[{int(i)}]{why}")
    return tree_map(lambda *xs: np.stack(xs), *items)


def stack_raw(raws: Sequence, indices: Sequence[int], name: str, ref: dict,
              keep_64bit: bool = False) -> dict:
    """The default collate, like torch's default_collate: field by field, torch tensors with
    torch.stack, numpy with np.stack, numbers into an array; the batch is checked against
    `ref`. Anything odd goes the slow way, item by item, to name the bad item."""
    try:
        first = raws[0]
        if isinstance(first, tuple) and len(first) in (2, 3):  # (x, y[, w]): by column
            if set(map(len, raws)) != {len(first)}:
                raise ValueError("ragged tuples")
            columns = list(zip(*raws, strict=True))
            batch = {k: _stack_fields(list(c), keep_64bit)  # 2 or 3 of the 3 keys
                     for k, c in zip(TUPLE_KEYS, columns, strict=False)}
        else:
            batch = _stack_fields([as_dict(r, name) for r in raws], keep_64bit)
        if mismatch(ref, signature(batch, batched=True), "") is None:
            return batch
    except Exception:  # named precisely below
        pass
    items = [to_numpy_item(r, f"{name}[{int(i)}]", keep_64bit)
             for r, i in zip(raws, indices, strict=True)]
    return stack(items, indices, name, ref)


def _stack_fields(values: list, keep_64bit: bool):
    first = values[0]
    if isinstance(first, dict):
        return {k: _stack_fields([v[k] for v in values], keep_64bit) for k in first}
    if isinstance(first, (list, tuple)) and first and not isinstance(first[0], numbers.Number):
        return type(first)(_stack_fields([v[i] for v in values], keep_64bit)
                           for i in range(len(first)))
    if is_torch_tensor(first):
        torch = sys.modules["torch"]
        arr = torch.stack([v.detach() for v in values] if first.requires_grad else values).cpu()
        arr = arr.numpy() if arr.dtype != torch.bfloat16 else arr.float().numpy()
    elif isinstance(first, np.ndarray):
        arr = np.stack(values)
    else:
        arr = np.asarray(values)
    if arr.dtype.kind not in "biufc":
        raise TypeError(arr.dtype)
    if not keep_64bit and arr.dtype in _NARROW:
        arr = arr.astype(_NARROW[arr.dtype])
    return arr


def collate_with(collate_fn: Callable, raw_items: list, indices: Sequence[int], name: str,
                 keep_64bit: bool = False) -> dict:
    """A user (PyTorch-style) collate_fn on raw items; its result made numpy."""
    lo, hi = int(min(indices)), int(max(indices))
    where = f"{name}[{lo}..{hi}] (collate_fn)"
    try:
        out = collate_fn(list(raw_items))
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"{where}: {type(e).__name__}: {first_line(e)}") from e
    return to_numpy_item(out, where, keep_64bit)


def check_batch(batch: dict, ref: dict, rows: int, where: str) -> None:
    """A collated batch against the first batch's signature (trailing dims) and rows."""
    for path, leaf in flatten(batch):
        if not np.shape(leaf) or np.shape(leaf)[0] != rows:
            raise DataError(f"{where}{path}: leading dim of shape {np.shape(leaf)} is not "
                            f"the batch size {rows}")
    why = mismatch(ref, signature(batch, batched=True), "the first batch")
    if why:
        raise DataError(f"{where}{why}; jtrain compiles the step once, so every batch "
                        "needs the same shapes (pad to a fixed length in collate_fn)")
