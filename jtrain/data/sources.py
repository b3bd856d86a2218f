"""Map-style sources: `len` + `read(index, epoch, seed)` -> the item as the user's dataset
returns it (a torch tensor tuple, a dict of numpy, ...). Conversion to numpy and batching
happen later, in `jtrain.data.pipeline`.

Randomness is a function of (seed, epoch, index), never of global RNG state, so that a
resumed run and a run with worker processes read exactly the same items:
  * `with_transform(dataset, fn)` calls `fn(item, rng)` with a numpy Generator seeded from
    (seed, epoch, index);
  * a dataset seen (by the checks before training) drawing from torch's or numpy's
    global RNG (torchvision's random transforms do) gets that generator seeded once per
    batch from (seed, epoch, batch number, process) and the batch read in order under a
    lock (torch's generator is restored after); `watch_global_rng` collects the
    datasets seen, for the one warning line of the run (`global_rng_warning`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Callable

import numpy as np

from jtrain.errors import DataError, first_line

_MASK63 = (1 << 63) - 1
_GLOBAL_RNG_LOCK = threading.RLock()


def call_item(fn: Callable, where: str):
    """fn() with a user's exception turned into a one-line DataError (traceback kept as
    the cause for library users)."""
    try:
        return fn()
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"{where}: {type(e).__name__}: {first_line(e)}") from e


# Seed domains: what a seed is for. A domain and a shard are separate inputs, so no
# shard number can land in another domain (they once shared one number: "3 + shard"
# met the hold-out's 7 at shard 4).
DOMAIN_ITEM = 0        # item_rng: random transforms (seed, epoch, index)
DOMAIN_GLOBAL_RNG = 1  # a dataset's global RNG, seeded per batch; shard = process
DOMAIN_WORKER = 2      # a torch worker_info seed; shard = stream shard
DOMAIN_STREAM = 3      # a stream's global RNG, per element; shard = stream shard
DOMAIN_HOLDOUT = 4     # which stream elements data.val_fraction holds out


def item_seed(seed: int, epoch: int, index: int, domain: int = DOMAIN_ITEM,
              shard: int = 0) -> int:
    """A 63-bit seed mixing (seed, epoch, index, domain, shard): odd multipliers, then one
    splitmix64 finaliser (cheap: it runs per item)."""
    x = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB
         + domain * 0xD6E8FEB86659FD93 + shard * 0xA0761D6478BD642F) & 0xFFFFFFFFFFFFFFFF
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & _MASK63


def item_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The per-item Generator handed to random transforms.

    Examples:
        ```python
        from jtrain.data import item_rng

        rng = item_rng(seed=0, epoch=1, index=42)   # what with_transform hands fn
        rng.normal()                                # the same number on every call
        ```
    """
    return np.random.Generator(np.random.Philox(key=item_seed(seed, epoch, index)))


# The open watches (watch_global_rng), innermost last. A run's header says what its own
# checks saw: a logging record would reach the console only if something had configured
# logging (the command line sends it to train.log, a script shows it by accident).
_WATCHES: list[dict] = []


@contextlib.contextmanager
def watch_global_rng():
    """Collects, while open, the datasets the checks see drawing from a global RNG:
    {key: (name, class name, set of "torch" / "numpy")}."""
    seen: dict = {}
    _WATCHES.append(seen)
    try:
        yield seen
    finally:
        _WATCHES.remove(seen)


def global_rng_warning(seen: dict) -> str | None:
    """One line for the datasets `watch_global_rng` saw, None for none."""
    if not seen:
        return None
    names = ", ".join(f"{name} ({cls})" for name, cls, _ in seen.values())
    kinds = sorted(set().union(*(used for _, _, used in seen.values())), reverse=True)
    return (f"{names} {'draws' if len(seen) == 1 else 'draw'} from "
            f"{' and '.join(kinds)}'s global RNG when an item is read (torch.rand without a "
            "generator, say): jtrain seeds it once per batch from (seed, epoch, batch), so "
            "the run repeats and resumes exactly, but an item's draws depend on the batch "
            "size and the number of processes; use jtrain.data.with_transform(dataset, "
            "fn(item, rng)) for draws seeded per item")


def _is_torch_dataset(ds) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(ds, torch.utils.data.Dataset)


class GlobalRng:
    """Seeds torch's and numpy's global RNG for a dataset seen using them (and torch's for
    torch streams, always). The global generators are shared by all threads, so seeded
    reads hold a lock: grain's reader threads must not interleave their draws."""

    def __init__(self, dataset, always: bool = False):
        self.torch = always and _is_torch_dataset(dataset)
        self.numpy = False
        self.cls = type(dataset).__qualname__
        self.key = f"{self.cls}@{id(dataset):x}"  # one dataset, however many sources read it

    @property
    def active(self) -> bool:
        return self.torch or self.numpy

    @contextlib.contextmanager
    def seeded(self, seed: int):
        with _GLOBAL_RNG_LOCK:
            if self.numpy:
                np.random.seed(seed & 0xFFFFFFFF)
            if not self.torch:
                yield
                return
            gen = sys.modules["torch"].default_generator
            saved = gen.get_state()
            gen.manual_seed(seed)
            try:
                yield
            finally:
                gen.set_state(saved)  # the user's own global RNG stream is left as it was

    def call(self, fn: Callable, seed: int):
        if not self.active:
            return fn()
        with self.seeded(seed):
            return fn()

    def detect(self, fn: Callable, name: str):
        """fn() while watching torch's and numpy's global RNG; warns once if either moved."""
        used = []
        torch = sys.modules.get("torch")
        if torch is not None:
            gen = torch.default_generator
            saved = gen.get_state()
            gen.manual_seed(12345)
            before = gen.get_state()
        np_saved = np.random.get_state()
        np.random.seed(12345)
        try:
            out = fn()
        finally:
            if torch is not None:
                if not torch.equal(gen.get_state(), before):
                    used.append("torch")
                gen.set_state(saved)
            if np.random.get_state()[2] != 624:  # position moves with every draw
                used.append("numpy")
            np.random.set_state(np_saved)
        self.numpy |= "numpy" in used
        self.torch |= "torch" in used
        for seen in _WATCHES if used else ():
            seen.setdefault(self.key, (name, self.cls, set()))[2].update(used)
        return out


class MapSource:
    """Any map-style dataset (`len` + `getitem`, a torch Dataset included)."""

    def __init__(self, dataset, name: str):
        self.dataset, self.name = dataset, name
        self.rng = GlobalRng(dataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def read(self, index: int, epoch: int = 0, seed: int = 0):
        return self.read_batch([index], epoch, seed, key=int(index))[0]

    def read_batch(self, indices, epoch: int, seed: int, key: int, stream: int = 0) -> list:
        """The items at `indices`, in order. A dataset that draws from a global RNG gets
        it seeded once for the batch, from (seed, epoch, key, stream)."""
        if not self.rng.active:
            return self._get_all(indices)
        with self.rng.seeded(item_seed(seed, epoch, key, DOMAIN_GLOBAL_RNG, stream)):
            return self._get_all(indices)

    def _get_all(self, indices) -> list:
        ds = self.dataset
        indices = indices.tolist() if isinstance(indices, np.ndarray) else list(map(int, indices))
        try:
            return [ds[i] for i in indices]
        except DataError:
            raise
        except Exception:
            pass
        for i in indices:  # again, one by one, to name the item that fails
            call_item(lambda i=i: ds[i], f"{self.name}[{i}]")
        return [ds[i] for i in indices]

    def check_read(self, index: int):
        """read() for the checks before training: also detects global-RNG use."""
        return call_item(lambda: self.rng.detect(lambda: self.dataset[int(index)], self.name),
                         f"{self.name}[{index}]")

    def __repr__(self) -> str:  # deterministic: grain compares reprs on restore
        return f"MapSource({self.name}, {type(self.dataset).__name__}, n={len(self)})"


def is_array_tree(value) -> bool:
    """An array, or a (nested) dict whose leaves are all arrays."""
    if isinstance(value, dict):
        return bool(value) and all(is_array_tree(v) for v in value.values())
    return hasattr(value, "shape")


def _tree_map(fn, tree, path=""):
    if isinstance(tree, dict):
        return {k: _tree_map(fn, v, f"{path}.{k}" if path else str(k)) for k, v in tree.items()}
    return fn(tree, path)


def _tree_leaves(tree, path=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tree_leaves(v, f"{path}.{k}" if path else str(k))
    else:
        yield path, tree


class ArraySource:
    """Rows of a dict of equally long arrays; a field may itself be a dict of arrays
    (dict targets of a multi-head model: {"targets": {"x": ..., "y": ...}})."""

    def __init__(self, arrays: dict, name: str):
        if not arrays:
            raise DataError(f"{name}: an empty dict of arrays")
        self.arrays = _tree_map(lambda v, path: _array(v, f"{name}.{path}"), arrays)
        lengths = {path: len(v) for path, v in _tree_leaves(self.arrays)}
        if len(set(lengths.values())) != 1:
            raise DataError(f"{name}: fields have different lengths {lengths}")
        self._len, self.name = next(iter(lengths.values())), name

    def __len__(self) -> int:
        return self._len

    def read(self, index: int, epoch: int = 0, seed: int = 0) -> dict:
        return _tree_map(lambda v, _: v[index], self.arrays)

    def read_batch(self, indices, epoch: int, seed: int, key: int, stream: int = 0) -> list:
        return [self.read(i) for i in indices]

    check_read = read

    def __repr__(self) -> str:
        shapes = {path: v.shape for path, v in _tree_leaves(self.arrays)}
        return f"ArraySource({self.name}, {shapes})"


def _array(value, where: str) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    if arr.ndim == 0:
        raise DataError(f"{where}: a scalar is not a column of examples")
    return arr


class Subset:
    """Some rows of another source, by index (a train/validation split)."""

    def __init__(self, source, indices: np.ndarray, name: str):
        self.source, self.indices, self.name = source, np.asarray(indices, np.int64), name

    def __len__(self) -> int:
        return len(self.indices)

    def read(self, index: int, epoch: int = 0, seed: int = 0):
        return self.source.read(self.indices[index], epoch, seed)

    def read_batch(self, indices, epoch: int, seed: int, key: int, stream: int = 0) -> list:
        return self.source.read_batch(self.indices[np.asarray(indices)], epoch, seed, key,
                                      stream)

    def check_read(self, index: int):
        return self.source.check_read(self.indices[index])

    def __repr__(self) -> str:
        return f"Subset({self.name}, {self.source!r}, n={len(self)})"


def dataset_indices(source, positions) -> list[int]:
    """Rows `positions` of `source` as indices of the dataset the user passed: the part
    left after data.val_fraction's hold-out (a Subset) counts its own positions, not
    the dataset's rows; a transform keeps them."""
    rows = np.asarray(positions, np.int64)
    while isinstance(source, (Subset, Transformed)):
        if isinstance(source, Subset):
            rows = source.indices[rows]
        source = source.source
    return [int(i) for i in rows]


class Transformed:
    """`fn(item, rng)` applied after reading, rng from (seed, epoch, index)."""

    def __init__(self, source, fn: Callable[[Any, np.random.Generator], Any], name: str):
        self.source, self.fn, self.name = source, fn, name

    def __len__(self) -> int:
        return len(self.source)

    def read(self, index: int, epoch: int = 0, seed: int = 0):
        return self.read_batch([index], epoch, seed, key=int(index))[0]

    def read_batch(self, indices, epoch: int, seed: int, key: int, stream: int = 0) -> list:
        raws = self.source.read_batch(indices, epoch, seed, key, stream)
        return [call_item(lambda item=item, i=i: self.fn(item, item_rng(seed, epoch, int(i))),
                          f"{self.name}[{int(i)}] (transform)")
                for item, i in zip(raws, indices, strict=True)]

    def check_read(self, index: int):
        item = self.source.check_read(index)
        return call_item(lambda: self.fn(item, item_rng(0, 0, int(index))),
                         f"{self.name}[{int(index)}] (transform)")

    def __repr__(self) -> str:
        return f"Transformed({self.source!r}, {getattr(self.fn, '__name__', 'fn')})"


class WithTransform:
    """What `with_transform` returns: a dataset marked with a per-item random transform."""

    def __init__(self, dataset, fn: Callable):
        if not callable(fn):
            raise DataError(f"with_transform: fn must be callable, got {type(fn).__name__}")
        self.dataset, self.fn = dataset, fn

    def __len__(self):
        return len(self.dataset)


def with_transform(dataset, fn: Callable[[Any, np.random.Generator], Any]) -> WithTransform:
    """`dataset` whose items go through `fn(item, rng)`; `rng` is a numpy Generator seeded
    from (config seed, epoch, index): random augmentation that resumes exactly and does not
    depend on the number of worker processes.

    Examples:
        ```python
        import numpy as np
        from jtrain.data import with_transform

        def jitter(item, rng):                  # rng: a numpy Generator for this item
            x, y = item
            return x + rng.normal(0, 0.1, x.shape).astype(np.float32), y

        train_data = with_transform(dataset, jitter)
        ```
    """
    return WithTransform(dataset, fn)


def split_indices(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, held-out indices), both sorted; the held-out part is a seeded
    random `fraction` of [0, n) (at least one example when fraction > 0)."""
    order = np.random.default_rng([seed, 0x5B117]).permutation(n)
    n_val = max(1, int(round(n * fraction))) if fraction > 0 else 0
    return np.sort(order[n_val:]), np.sort(order[:n_val])
