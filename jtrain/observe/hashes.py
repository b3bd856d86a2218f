"""WORKDIR/hashes.jsonl (`debug.hash_every_steps = N`): every N steps, an exact digest of
the whole train state and the global example indices of the step's batch.

    {"step": 4, "hash": "<64 hex>", "parts": {"params": "<16 hex>", "opt_state": ...,
     "ema": ..., "rest": ...}, "examples": [17, 3, ...]}

The digest is computed on the devices, in a jitted function dispatched right after the
step (no host sync): for every leaf, two wrapping uint32 sums over its bit patterns,
one plain and one weighted by a multiplicative hash of the element's global flat index
(so a swap of two elements changes it too). Integer sums are exact and independent of
the order of addition, so the digest of a sharded array is that of the global array:
the same on 1 device, 8 devices or 2 processes for bitwise-equal state. The loop fetches
the small [leaves, 2] result when it drains that step (it reads the step's status then
anyway); the host hashes it with SHA-256 together with the leaf paths, dtypes and
shapes. A host SHA-256 of the full bytes (`jtrain.state.state_sha256`) would copy the
whole state off the devices (and gather it across processes) at every recorded step.

`examples` are the step's batch as indices of the dataset the user passed (map-style
data, rows held out by data.val_fraction counted; null for streams and mixtures).
Process 0 writes; a resumed run first drops the lines after its restored step (like
metrics.jsonl), so each step appears once.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jtrain.observe import jsonl
from jtrain.observe import layout
from jtrain.optim import leaf_path

HASH_FILE = "hashes.jsonl"
_GOLDEN = np.uint32(2654435761)  # Knuth's multiplicative hash constant
PARTS = ("params", "opt_state", "ema")  # the rest (step, rng, loss scale, ...) is "rest"


def _bits(x) -> jax.Array:
    """x's bit patterns as uint32 (smaller types widened, wider ones split)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = jnp.dtype(x.dtype).itemsize
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}.get(size, jnp.uint32)
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _leaf_sums(x) -> jax.Array:
    """[2] uint32: the plain and the index-weighted wrapping sums of x's bits."""
    bits = _bits(x)
    flat = jnp.zeros(bits.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(bits.ndim)):  # the global flat index, computed per element
        flat = flat + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, d) * np.uint32(stride)
        stride = (stride * bits.shape[d]) % (1 << 32)
    weights = flat * _GOLDEN + np.uint32(1)
    return jnp.stack([jnp.sum(bits, dtype=jnp.uint32),
                      jnp.sum(bits * weights, dtype=jnp.uint32)])


def digest_on_device(state) -> jax.Array:
    """[leaves, 2] uint32, in tree order (see the module docstring)."""
    leaves = jax.tree.leaves(state)
    return jnp.stack([_leaf_sums(x) for x in leaves]) if leaves else jnp.zeros((0, 2),
                                                                               jnp.uint32)


def make_digest(mesh=None) -> Callable:
    """The jitted digest; on `mesh`, its result replicated (every process reads it)."""
    if mesh is None:
        return jax.jit(digest_on_device)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.jit(digest_on_device, out_shardings=replicated)


def describe(state) -> list[tuple[str, str]]:
    """(path, "dtype[shape]") per leaf, in tree order: what the host hash covers."""
    return [(leaf_path(p), f"{jnp.dtype(x.dtype).name}{list(x.shape)}")
            for p, x in jax.tree_util.tree_flatten_with_path(state)[0]]


def finish(sums: np.ndarray, layout: list[tuple[str, str]]) -> dict:
    """{"hash": 64 hex, "parts": {part: 16 hex}} from the fetched sums and the layout."""
    whole, parts = hashlib.sha256(), {}
    for (path, shape), row in zip(layout, np.asarray(sums, np.uint32), strict=True):
        piece = f"{path}:{shape}:{int(row[0]):08x}{int(row[1]):08x};".encode()
        whole.update(piece)
        part = path.split("/", 1)[0]
        part = part if part in PARTS else "rest"
        parts.setdefault(part, hashlib.sha256()).update(piece)
    return {"hash": whole.hexdigest(),
            "parts": {k: v.hexdigest()[:16] for k, v in sorted(parts.items())}}


def state_digest(state, mesh=None) -> dict:
    """The digest of a state now ({"hash", "parts"}): what hashes.jsonl records."""
    return finish(jax.device_get(make_digest(mesh)(state)), describe(state))


class Recorder:
    """The loop's side of hashes.jsonl: `dispatch(step, state)` right after a step
    (no sync), `drained(step)` when the loop drains it (fetch, write)."""

    def __init__(self, workdir: str, every: int, *, primary: bool, resumed_step: int | None,
                 examples_of: Callable[[int], list | None], mesh=None):
        self.every, self.primary, self.examples_of = every, primary, examples_of
        self.path = os.path.join(workdir, HASH_FILE)
        self._pending: dict[int, jax.Array] = {}
        self._digest = make_digest(mesh) if every else None
        self._layout: list | None = None
        if every and primary and os.path.exists(self.path):
            jsonl.truncate_after(self.path, resumed_step or 0)

    def dispatch(self, step: int, state) -> None:
        if not self.every or step % self.every:
            return
        if self._layout is None:
            self._layout = describe(state)
        self._pending[step] = self._digest(state)

    def drained(self, step: int) -> None:
        sums = self._pending.pop(step, None)
        if sums is None:
            return
        sums = jax.device_get(sums)
        if not self.primary:
            return
        record = {"step": step, **finish(sums, self._layout), "examples": self.examples_of(step)}
        with layout.open_append(self.path) as f:
            f.write(json.dumps(record) + "\n")


def first_difference(a: dict, b: dict) -> tuple[str, float] | None:
    """(path, max abs difference) of the first leaf that differs between
    two {path: numpy array} states; a leaf missing on one side or of another shape
    counts as differing with an infinite difference. None when they are bitwise equal."""
    def order(path):  # params first, then the optimizer state, the EMA, the rest
        part = path.split("/", 1)[0]
        return (PARTS.index(part) if part in PARTS else len(PARTS), path)

    for path in sorted(set(a) | set(b), key=order):
        x, y = a.get(path), b.get(path)
        if x is None or y is None or np.shape(x) != np.shape(y):
            return path, float("inf")
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype != y.dtype or x.tobytes() != y.tobytes():
            try:
                d = np.abs(x.astype(np.float64) - y.astype(np.float64))
            except (TypeError, ValueError):
                return path, float("inf")
            return path, float(np.nanmax(d)) if d.size and not np.isnan(d).all() else 0.0
    return None


def read(workdir: str) -> list[dict]:
    """The records of WORKDIR/hashes.jsonl, by step (a torn last line is skipped); a
    malformed line is one WorkdirError naming the file, the line and the field."""
    records = jsonl.read_records(os.path.join(workdir, HASH_FILE), check=_check_record)
    return sorted(records, key=lambda r: r["step"])


def _check_record(record: dict) -> str | None:
    """Why a hashes.jsonl record is malformed (None if it is not)."""
    if not isinstance(record.get("hash"), str):
        return "hash: expected a string"
    parts = record.get("parts", {})
    if not isinstance(parts, dict) or not all(isinstance(v, str) for v in parts.values()):
        return "parts: expected an object of part name -> hash"
    examples = record.get("examples")
    if examples is not None and not isinstance(examples, list):
        return "examples: expected a list of indices or null"
    return None
