"""Weighted data mixtures (data.mixture, jtrain.data.Mixture): several datasets sampled
by weight into one train stream, with exact positions.

Global batch b, slot j takes component c with probability weights(b)[c] (the weights of
data.mixture_schedule in force at batch b, which is the step that trains on it), drawn
from (seed, b // CHUNK): a pure function of the batch number, independent of the number
of processes (process p takes slots [p*b, (p+1)*b) of the global batch, as for one
dataset). The n-th draw of component c reads its example order(epoch)[n mod N_c], epoch
= n // N_c, order a permutation from (seed, c, epoch) when data.shuffle: each component
runs through its own epochs. n is counted by replaying the draws (vectorised, cached per
chunk), so the position is still one integer; the data state also records each
component's draws and epochs.

Components are opened as any input (load.as_data) and must agree on their fields, shapes
and dtypes (a DataError names the component that differs). A stream component (no len)
is consumed in order: its n-th draw is its n-th element, read by every process
(mixture_streams.py).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, ClassVar

import numpy as np

from jtrain.data import items as items_lib, mixture_streams, pipeline
from jtrain.data.dataset import MapData, StreamData
from jtrain.data.items import DataError

CHUNK = 256  # batches drawn together


class Mixture:
    """`train_data=Mixture({"a": ds_a, "b": ds_b}, weights={"a": 0.7, "b": 0.3})`:
    components are any map-style input (arrays, a torch Dataset, a grain MapDataset,
    ...); `eval` optionally maps component names to their eval sets. Weights need not
    sum to 1 (they are normalised); data.mixture_schedule can change them at steps.

    Examples:
        ```python
        import jtrain
        from jtrain.data import Mixture

        data = Mixture({"web": web_ds, "code": code_ds}, weights={"web": 3, "code": 1},
                       eval={"web": web_eval, "code": code_eval})
        result = jtrain.train(config, "runs/mix", model=Net, train_data=data)
        print(result.summary["eval/web/loss"], result.summary["eval/code/loss"])
        ```
    """

    def __init__(self, components: dict, weights: dict | None = None,
                 eval: dict | None = None):  # noqa: A002 - the split's name
        if not isinstance(components, dict) or not components:
            raise DataError("data.mixture", "a mixture needs a dict of named components")
        weights = {k: 1.0 for k in components} if weights is None else dict(weights)
        if set(weights) != set(components):
            raise DataError("data.mixture", f"weights name {sorted(weights)}, components "
                                            f"are {sorted(components)}")
        self.components, self.weights = dict(components), weights
        self.eval = dict(eval or {})


def from_config(data_cfg, load_one) -> Mixture:
    """data.mixture = {name: {"source", "kwargs", "weight"}} -> a Mixture; `load_one(
    source, kwargs)` returns (train, eval or None) of one component."""
    comps, weights, evals = {}, {}, {}
    for name, spec in _plain(data_cfg.mixture).items():
        unknown = set(spec) - {"source", "kwargs", "weight"}
        if unknown or "source" not in spec:
            raise DataError(f"data.mixture.{name}", "expected {'source': 'pkg.mod:fn' or a "
                            "built-in data name, 'kwargs': {...}, 'weight': w}" +
                            (f"; unknown keys {sorted(unknown)}" if unknown else ""))
        comps[name], ev = load_one(spec["source"], dict(spec.get("kwargs", {})), name)
        weights[name] = spec.get("weight", 1.0)
        if ev is not None:
            evals[name] = ev
    return Mixture(comps, weights, evals)


def _plain(value):
    return value.to_dict() if hasattr(value, "to_dict") else dict(value)


def schedule_table(names: list, weights: dict, schedule: dict) -> tuple[np.ndarray, np.ndarray]:
    """(starting batches [S], normalised weights [S, K]) from the base weights and
    data.mixture_schedule {step: {name: weight}} (names left out of an entry weigh 0)."""
    rows = {0: [weights[n] for n in names]}
    for step, entry in _plain(schedule or {}).items():
        try:
            at = int(step)
        except (TypeError, ValueError):
            raise DataError("data.mixture_schedule", f"keys are steps, got {step!r}") from None
        unknown = set(entry) - set(names)
        if unknown or at < 0:
            raise DataError("data.mixture_schedule", f"step {step}: " + (
                f"unknown components {sorted(unknown)}; the mixture has {names}"
                if unknown else "steps are >= 0"))
        rows[at] = [entry.get(n, 0.0) for n in names]
    starts = np.array(sorted(rows), np.int64)
    table = np.array([rows[s] for s in starts], np.float64)
    if not np.all(np.isfinite(table)) or (table < 0).any() or (table.sum(1) <= 0).any():
        raise DataError("data.mixture", f"weights must be >= 0 with a positive sum, got "
                        f"{dict(zip(starts.tolist(), table.tolist(), strict=True))}")
    return starts, table / table.sum(1, keepdims=True)


class ConcatSource:
    """The components side by side. Index = epoch * total + offset[c] + example. The
    components numbered in `streams` are streams: size 0 here, never located."""

    def __init__(self, sources: list, names: list, streams: tuple = ()):
        self.sources, self.names, self.streams = sources, names, tuple(streams)
        self.sizes = np.array([0 if c in self.streams else len(s)
                               for c, s in enumerate(sources)], np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]])
        self.total = int(self.sizes.sum())
        self.name = "train_data"

    def __len__(self) -> int:
        return self.total

    def locate(self, index: int) -> tuple[int, int, int]:
        epoch, rest = divmod(int(index), self.total)
        c = int(np.searchsorted(self.offsets, rest, side="right") - 1)
        return c, epoch, rest - int(self.offsets[c])

    def read(self, index: int, epoch: int = 0, seed: int = 0):
        c, e, i = self.locate(index)
        return self.sources[c].read(i, e, seed)

    def read_batch(self, indices, epoch: int, seed: int, key: int, stream: int = 0) -> list:
        out: list = [None] * len(indices)
        groups: dict = {}
        for j, index in enumerate(indices):
            c, e, i = self.locate(index)
            groups.setdefault((c, e), []).append((j, i))
        for (c, e), rows in groups.items():
            items = self.sources[c].read_batch([i for _, i in rows], e, seed, key, stream)
            for (j, _), item in zip(rows, items, strict=True):
                out[j] = item
        return out

    def check_read(self, index: int):
        c, _, i = self.locate(index)
        return self.sources[c].check_read(i)

    def __repr__(self) -> str:
        return f"ConcatSource({', '.join(map(repr, self.sources))})"


class MixturePlan:
    """Global batch number -> (epoch 0, number, encoded indices [b], valid [b])."""

    def __init__(self, source: ConcatSource, starts, table, *, global_batch: int,
                 local_batch: int, process_index: int, seed: int, shuffle: bool):
        self.source, self.starts, self.table = source, starts, table
        self.global_batch, self.local_batch = global_batch, local_batch
        self.offset, self.seed, self.shuffle = process_index * local_batch, seed, shuffle
        self.k = len(source.sizes)
        self._before = [np.zeros(self.k, np.int64)]  # draws per component before chunk i
        self._lock = threading.Lock()
        self._orders: dict = {}

    def choices(self, chunk: int) -> np.ndarray:
        """Components of every slot of the chunk's batches [CHUNK, global_batch]."""
        numbers = chunk * CHUNK + np.arange(CHUNK)
        row = np.searchsorted(self.starts, numbers, side="right") - 1
        cum = np.cumsum(self.table[row], axis=1)[:, :-1]  # [CHUNK, K-1]
        u = np.random.default_rng([self.seed, chunk, 0x313C]).random(
            (CHUNK, self.global_batch))
        return (u[:, :, None] >= cum[:, None, :]).sum(-1)  # [CHUNK, B]

    def counts_before(self, number: int) -> np.ndarray:
        """Draws per component in batches [0, number)."""
        chunk, k = divmod(int(number), CHUNK)
        with self._lock:
            while len(self._before) <= chunk:
                i = len(self._before) - 1
                self._before.append(self._before[i] + np.bincount(
                    self.choices(i).ravel(), minlength=self.k))
            base = self._before[chunk].copy()
        if k:
            base += np.bincount(self.choices(chunk)[:k].ravel(), minlength=self.k)
        return base

    def order(self, c: int, epoch: int) -> np.ndarray:
        n = int(self.source.sizes[c])
        if not self.shuffle:
            return np.arange(n)
        key = (c, epoch)
        if key not in self._orders:
            if len(self._orders) > 4 * self.k:
                self._orders.clear()
            self._orders[key] = np.random.default_rng([self.seed, c, epoch, 0x313D]) \
                .permutation(n)
        return self._orders[key]

    def row(self, number: int) -> np.ndarray:
        """The component of every slot of global batch `number` [B]."""
        chunk, k = divmod(int(number), CHUNK)
        return self.choices(chunk)[k]

    def index(self, c: int, n: int) -> int:
        """The encoded index of the n-th draw of map-style component c."""
        epoch, i = divmod(n, int(self.source.sizes[c]))
        return (epoch * self.source.total + int(self.source.offsets[c])
                + int(self.order(c, epoch)[i]))

    def __call__(self, number: int):
        row = self.row(number)  # [B]
        before = self.counts_before(number)
        indices = np.empty(self.local_batch, np.int64)
        for j in range(self.local_batch):
            slot = self.offset + j
            c = int(row[slot])
            indices[j] = self.index(c, int(before[c]) + int(np.count_nonzero(row[:slot] == c)))
        return 0, int(number), indices, np.ones(self.local_batch, bool)


class MixtureIterator(pipeline.MapIterator):
    """MapIterator over a MixturePlan: the position plus each component's draws."""

    def get_state(self) -> dict:
        p = self.plan
        draws = p.counts_before(self.position)
        return {"kind": "mixture", "position": self.position,
                "components": list(p.source.names),
                "sizes": p.source.sizes.tolist(), "global_batch": p.global_batch,
                "draws": draws.tolist(),
                "epochs": [int(d) // int(n) for d, n in zip(draws, p.source.sizes, strict=True)]}

    def set_state(self, state: dict) -> None:
        p, name = self.plan, self.reader.name
        mixture_streams.check_kind(state, name)
        saved = (state.get("components"), state.get("sizes"), state.get("global_batch"))
        now = (list(p.source.names), p.source.sizes.tolist(), p.global_batch)
        if saved != now:
            raise DataError(f"{name}: the checkpoint's mixture is {saved[0]} of sizes "
                            f"{saved[1]}, global batch {saved[2]}; this run has {now[0]}, "
                            f"{now[1]}, {now[2]} (restore them or use a new workdir)")
        self.close()
        self.position = int(state["position"])


@dataclasses.dataclass
class MixtureData(MapData):
    """A mixture: `source` is a ConcatSource; `weights` (starts, table) its schedule."""
    schedule: Any = None
    eval_parts: dict = dataclasses.field(default_factory=dict)  # name -> checked eval Data
    stream_parts: dict = dataclasses.field(default_factory=dict)  # c -> checked StreamData
    kind: ClassVar[str] = "mixture"

    def split_off_eval(self, fraction, split_seed):
        raise DataError("data.val_fraction", "a mixture is split per component (internal)")

    @property
    def known_size(self) -> int | None:
        return None if self.stream_parts else len(self.source)

    def __len__(self) -> int:  # the map-style components' examples (random access)
        return len(self.source)

    def train_iterator(self, *, local_batch, seed, shuffle, process_index, process_count,
                       num_workers, drop_last, prefetch, num_threads):
        reader = self.batch_reader(seed=seed, mask=not drop_last, stream=process_index)
        starts, table = self.schedule
        plan = MixturePlan(self.source, starts, table, global_batch=local_batch *
                           process_count, local_batch=local_batch,
                           process_index=process_index, seed=seed, shuffle=shuffle)
        if self.stream_parts:
            return mixture_streams.StreamMixtureIterator(plan, reader, self.stream_parts)
        return MixtureIterator(plan, reader, num_workers=num_workers,
                               num_threads=num_threads, prefetch=prefetch,
                               worker_init_fn=self.worker_init_fn)


def combine(checked: dict, schedule: tuple, names: list) -> MixtureData:
    """One MixtureData of checked map-style components (`checked[name]` = the checked
    Data); a DataError names the component whose fields differ from the first's."""
    first = names[0]
    ref = checked[first].ref
    for name in names[1:]:
        why = items_lib.mismatch(ref, checked[name].ref, f"component {first!r}")
        if why:
            raise DataError(f"data.mixture.{name}{why}")
    streams = {c: checked[n] for c, n in enumerate(names)
               if isinstance(checked[n], StreamData)}
    source = ConcatSource([checked[n].source for n in names], names, tuple(streams))
    notes = [f"{n}: {line}" for n in names for line in checked[n].notes]
    if len(schedule[0]) > 1:
        notes.append("weights change at steps " + ", ".join(map(str, schedule[0][1:].tolist())))
    return MixtureData("train_data", source, "mixture", ref=ref,
                       sample=checked[first].sample, notes=notes,
                       collate_fn=checked[first].collate_fn, schedule=schedule,
                       stream_parts=streams)


def report(data_state: dict, schedule: tuple) -> dict | None:
    """summary.json's `data.mixture` from a mixture's data state: per component the
    weight of the last batch drawn, its size, its draws and its epochs run through
    (draws / size; a stream component: size "stream", epochs its completed passes);
    None for any other data."""
    if not isinstance(data_state, dict) or data_state.get("kind") != "mixture":
        return None
    starts, table = schedule
    last = max(int(data_state["position"]) - 1, 0)
    weights = table[int(np.searchsorted(starts, last, side="right")) - 1]
    return {name: {"weight": round(float(w), 6), "size": n, "draws": int(d),
                   "epochs": e if n == "stream" else round(int(d) / int(n), 3)}
            for name, w, n, d, e in zip(data_state["components"], weights,
                                        data_state["sizes"], data_state["draws"],
                                        data_state["epochs"], strict=True)}


def report_line(block: dict, batches: int) -> str:
    """`jtrain: mixture over 20 batches: a 170 drawn (0.85 epochs), b 150 drawn (1.5
    epochs)`: the end-of-run console line."""
    return f"jtrain: mixture over {batches:,} batches: " + ", ".join(
        f"{n} {v['draws']:,} drawn ({v['epochs']:g} epochs)" for n, v in block.items())


def components_line(info_mixture: list) -> str:
    """The header's components (instead of one dataset's batches per epoch)."""
    return f"mixture of {len(info_mixture)}: " + ", ".join(
        f"{c['name']} ({c['weight']:.2f}, " + (
            "stream" if c["examples"] is None else f"{c['examples']:,} examples") + ")"
        for c in info_mixture)
