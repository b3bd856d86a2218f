"""Everything between a user's dataset and per-process numpy batches. Reads `config.data`.

A run hands its data over once (prepare.py): `UserData` opens what the user passed
before the config is resolved (a DataLoader's settings become data.* in that one
resolution), `prepare(...)` returns the `RunData` that owns the checked sources, example
0, the vocab check, the train iterator at its restored position and the eval plan.
Behind it: load, torch_adapters (what the user passed), checks, items, the iterators
(pipeline, streams, grain_sources), evalsets, mixture, mixture_streams, packing, text,
tokens, tokenizer and chat (WORKSPACE.md's map says what each holds).

Yields numpy only, knows nothing about devices and calls no collective (the one
cross-process count it needs comes through the `gather` the caller passes);
`jtrain.mesh.host_to_device` makes a per-process batch a global array (prefetch.py is
handed that function). Batches are dicts of numpy arrays: `inputs` (an array or a
pytree), `targets`, optional `weights`; eval batches (and train batches with
data.drop_last=False) have `mask` [b].
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import numpy as np

from jtrain.data import chat, checks, evalsets, items as items_lib, load, mixture, packing
from jtrain.data import pipeline, sources as sources_lib, text, tokens, torch_adapters
from jtrain.data.items import DataError
from jtrain.data.dataset import Data, MapData, StreamData
from jtrain.data.mixture import Mixture
from jtrain.data.prefetch import DevicePrefetch
from jtrain.data.sources import MapSource, item_rng, with_transform

# The names a user's code imports (docs/reference/api.md); the rest of this module is
# the engine's hand-off (prepare, RunData, make_sources, ...), reached as attributes.
__all__ = ["DataError", "Mixture", "item_rng", "with_transform"]

# name -> make(seq_len, val_fraction, path, cache) -> (train, eval or None, info); cache:
# the run's workdir, where shards on a bucket are fetched to (None outside a run)
BUILTIN = {"pystdlib": lambda seq_len, val_fraction, path, cache=None: text.make_pystdlib(
    seq_len, val_fraction), "tokens": tokens.make_tokens}
VOCAB_SCAN = 1024  # examples check_vocab reads (all of them for smaller datasets)
example_indices = pipeline.example_indices
load_named = load.load_named


def check_vocab(model_cfg, data: Data) -> None:
    """ConfigError naming model.vocab_size when a token id in the first VOCAB_SCAN
    examples' integer inputs / targets is not below it (an embedding lookup out of range
    does not fail on device: it clamps, and the run trains on garbage)."""
    vocab = model_cfg.get("vocab_size")
    if vocab is None:
        return
    from jtrain.errors import ConfigError

    n = min(len(data), VOCAB_SCAN) if isinstance(data, MapData) else 1
    for i in range(max(n, 1)):
        example = data[i]
        for key in ("inputs", "targets"):
            if example.get(key) is None:
                continue
            for _, leaf in items_lib.flatten(example[key]):
                if np.issubdtype(np.asarray(leaf).dtype, np.integer) and np.size(leaf):
                    top = int(np.max(leaf))
                    if top >= vocab:
                        raise ConfigError("model.vocab_size", (
                            f"{vocab} is not above the largest token id in {data.name}: "
                            f"{top} (in {key!r} of example {i}); set model.vocab_size "
                            f">= {top + 1}"))


def as_data(obj, name: str) -> Data:
    """Any accepted input (arrays, a dataset, a stream, ...) as a checked `Data` whose
    `[i]` is example i as the model sees it (e.g. for `jtrain.evaluate.run_eval`)."""
    return checks.check(load.as_data(obj, name), global_batch=1, train=False)


def load_user_data(data_cfg, train_data=None, eval_data=None, *, process_index: int = 0,
                   process_count: int = 1):
    """Before the config is validated against the devices: the factory named by
    data.source is called, and a torch DataLoader's batch_size (per process), shuffle,
    drop_last and num_workers are returned as `data.*` overrides (the header says so).

    Returns (train_data, eval_data, overrides); the caller builds a new config from the
    overrides (the validated config is never changed in place)."""
    overrides: dict = {}
    if train_data is None and data_cfg.source:
        train_data, factory_eval = load.from_factory(data_cfg)
        eval_data = factory_eval if eval_data is None else eval_data
    if torch_adapters.is_dataloader(train_data):
        train_data, overrides = load.adopt_loader(train_data, process_index, process_count)
    if torch_adapters.is_dataloader(eval_data):
        eval_data = torch_adapters.read_dataloader(eval_data, "eval_data", process_index,
                                                   process_count)
    return train_data, eval_data, overrides


def make_sources(data_cfg, train_data=None, eval_data=None, *, process_index: int = 0,
                 process_count: int = 1, gather=None, cache: str | None = None,
                 ) -> tuple[Data, Data | None, dict]:
    """(train, eval or None, info) from user data, data.source, or data.name. `gather(n)`
    returns n from every process (`jtrain.mesh.process_values`): needed with several
    processes and a stream eval set, which must agree on its batch count. info's
    "warnings": lines the run's header shows (datasets drawing from a global RNG)."""
    with sources_lib.watch_global_rng() as seen:
        train, ev, info = _make_sources(data_cfg, train_data, eval_data, process_index,
                                        process_count, gather, cache)
    line = sources_lib.global_rng_warning(seen)
    info["warnings"] = [line] if line else []
    return train, ev, info


def _make_sources(data_cfg, train_data, eval_data, process_index, process_count, gather,
                  cache):
    if train_data is None and data_cfg.source:
        train_data, eval_data, _ = load_user_data(data_cfg, None, eval_data,
                                                  process_index=process_index,
                                                  process_count=process_count)
    if data_cfg.mixture and train_data is None:
        train_data = mixture.from_config(data_cfg, lambda *a: _component(*a, cache=cache))
    if isinstance(train_data, Mixture):
        return _mixture_sources(data_cfg, train_data, process_index, process_count)
    if data_cfg.packing != "none":
        train_data = packing.pack(train_data, data_cfg, "train_data")
        eval_data = packing.pack(eval_data, data_cfg, "eval_data")
    if train_data is None:
        train, ev, info = _builtin(data_cfg, cache)
        if eval_data is not None:
            ev = load.as_data(eval_data, "eval_data")
    else:
        train = load.as_data(train_data, "train_data")
        ev = load.as_data(eval_data, "eval_data") if eval_data is not None else None
        if ev is None:
            train, ev = (train.split_off_eval(data_cfg.val_fraction, data_cfg.split_seed)
                         if data_cfg.val_fraction > 0 else (train, None))
        info = {"name": train.description}
        train = dataclasses.replace(train, notes=train.notes + packing.note(train_data))
    if data_cfg.transform:
        train = load.add_transform(train, load.load_named(data_cfg.transform, "data.transform"))
    train = checks.check(train, global_batch=data_cfg.batch_size, process_index=process_index,
                 process_count=process_count, drop_last=data_cfg.drop_last, train=True)
    if ev is not None and not ev.in_memory:
        ev = evalsets.read_eval_set(ev, process_index=process_index, process_count=process_count,
                                    workers=max(1, data_cfg.num_workers), gather=gather)
    if ev is not None:
        ev = checks.check(ev, global_batch=data_cfg.batch_size, process_index=process_index,
                     process_count=process_count, train=False)
    info.update(kind=train.kind, notes=list(train.notes),
                num_examples=train.known_size,
                num_eval_examples=len(ev) if ev is not None else 0,
                batches_per_epoch=checks.batches_per_epoch(train, data_cfg.batch_size,
                                                           data_cfg.drop_last))
    return train, ev, info


def _component(source: str, kwargs: dict, name: str, cache: str | None = None):
    """(train, eval or None) of one data.mixture component: a factory or a built-in."""
    if ":" not in source:
        if source not in BUILTIN:
            raise DataError(f"data.mixture.{name}.source", f"{source!r} is neither "
                            f"'package.module:function' nor a built-in ({', '.join(BUILTIN)})")
        train, val, _ = BUILTIN[source](kwargs.get("seq_len", 128), 0.05,
                                        kwargs.get("path", ""), cache)
        return train, val
    return load.from_factory(_Factory(source, kwargs))


class _Factory:  # what load.from_factory reads of data_cfg
    def __init__(self, source, kwargs):
        self.source, self.kwargs = source, kwargs


def _mixture_sources(data_cfg, mix: Mixture, process_index: int, process_count: int):
    """(train MixtureData, the components' eval sets together or None, info); info's
    "eval_parts" maps each component with an eval set to it (per-component eval)."""
    names, checked, evals = list(mix.components), {}, {}
    for name in names:
        where = f"data.mixture.{name}"
        raw = packing.pack(mix.components[name], data_cfg, where)
        part = load.as_data(raw, where)
        part = dataclasses.replace(part, notes=part.notes + packing.note(raw))
        if not isinstance(part, (MapData, StreamData)):
            raise DataError(where, f"a {part.description} component: a mixture takes "
                                   "map-style data or streams, not a loader of batches")
        ev_raw = mix.eval.get(name)
        if ev_raw is not None:
            ev = load.as_data(packing.pack(ev_raw, data_cfg, f"{where} (eval)"),
                              f"{where} (eval)")
        elif data_cfg.val_fraction > 0:
            part, ev = part.split_off_eval(data_cfg.val_fraction, data_cfg.split_seed)
        else:
            ev = None
        if isinstance(ev, StreamData):  # read whole, alike on every process
            ev = load.as_data(ev.local_rows(0, 1, workers=1, limit=None), f"{where} (eval)")
        if isinstance(part, StreamData):
            part = dataclasses.replace(part, notes=part.notes + [
                "a stream: read whole and in order by every process, in the main thread "
                "(data.num_workers does not apply to this mixture)"])
        if data_cfg.transform:
            part = load.add_transform(part, load.load_named(data_cfg.transform,
                                                            "data.transform"))
        checked[name] = checks.check(part, global_batch=1, train=True)
        if ev is not None:
            evals[name] = checks.check(dataclasses.replace(ev, name=f"eval_data ({name})"),
                                       global_batch=1, train=False)
    schedule = mixture.schedule_table(names, mix.weights, data_cfg.mixture_schedule)
    train = dataclasses.replace(mixture.combine(checked, schedule, names), eval_parts=evals)
    train = checks.check(train, global_batch=data_cfg.batch_size, train=True)
    ev = None
    if evals:
        both = mixture.ConcatSource([e.source for e in evals.values()], list(evals))
        ev = checks.check(MapData("eval_data", both, "mixture eval sets"),
                          global_batch=data_cfg.batch_size, process_index=process_index,
                          process_count=process_count, train=False)
    info = {"name": "mixture", "kind": train.kind, "notes": list(train.notes),
            "num_examples": train.known_size, "num_eval_examples": len(ev) if ev else 0,
            "batches_per_epoch": None,
            "mixture": [{"name": n, "weight": float(w), "examples": checked[n].known_size
                         if isinstance(checked[n], MapData) else None}
                        for n, w in zip(names, schedule[1][0], strict=True)]}
    info["components"] = mixture.components_line(info["mixture"])  # the header's data line
    return train, ev, info


def _builtin(data_cfg, cache):
    if data_cfg.name not in BUILTIN and data_cfg.name != "chat":
        raise DataError(f"data.name: unknown dataset {data_cfg.name!r}; built-in: "
                        f"{', '.join(BUILTIN)}, chat (or name your own with data.source)")
    if data_cfg.packing != "none" and data_cfg.name != "chat":  # windows already
        raise DataError("data.packing", f"{data_cfg.packing!r} with data.name="
                        f"{data_cfg.name}: its windows already run across document "
                        "boundaries; set data.packing=none, or pack your documents "
                        "(data.source) instead")
    try:
        train, val, info = chat.make_chat(data_cfg) if data_cfg.name == "chat" else \
            BUILTIN[data_cfg.name](data_cfg.seq_len, data_cfg.val_fraction, data_cfg.path,
                                   cache)
    except text.CorpusError as e:
        raise DataError(str(e)) from None
    ev = MapData("eval_data", MapSource(val, "eval_data"), data_cfg.name) if val is not None \
        else None
    return MapData("train_data", MapSource(train, "train_data"), data_cfg.name), ev, info


def make_train_iterator(source, *, local_batch: int, seed: int, shuffle: bool,
                        process_index: int, process_count: int, num_workers: int = 0,
                        drop_last: bool = True, prefetch: int = 2, num_threads: int = 0):
    """Endless per-process batches with `get_state()` / `set_state()` (JSON dicts)."""
    data = source if isinstance(source, Data) else load.as_data(source, "train_data")
    if data.ref is None:
        data = checks.check(data, global_batch=local_batch * process_count, drop_last=drop_last,
                     process_index=process_index, process_count=process_count, train=True)
    return data.train_iterator(local_batch=local_batch, seed=seed, shuffle=shuffle,
                               process_index=process_index, process_count=process_count,
                               num_workers=num_workers, drop_last=drop_last,
                               prefetch=prefetch, num_threads=num_threads)


def device_prefetch(host_iter, put: Callable, depth: int) -> DevicePrefetch:
    """`put(batch)` (the host->device transfer) applied `depth` batches ahead in a thread;
    depth 0 transfers in the caller. Keeps get_state() at the step's position.

    depth -1 (the default, `data.device_prefetch`) means 2 on GPU/TPU and 0 on CPU: there
    the "device" is host memory, and on a dispatch-bound model the hand-off to a thread
    cost ~10 % of the step time (`bench overhead --model tiny`: 1.11x with it, 1.02x
    without), while async dispatch already overlaps loading with the steps in flight."""
    if depth < 0:
        import jax

        depth = 0 if jax.default_backend() == "cpu" else 2
    return DevicePrefetch(host_iter, put, depth)


def eval_batches(source, *, local_batch: int, process_index: int, process_count: int,
                 max_batches: int = 0) -> Iterator[dict[str, Any]]:
    """Every example exactly once, in order, in padded batches with a `mask` [b]; the
    same number of batches on every process, so the eval step compiles once."""
    data = source if isinstance(source, Data) else load.as_data(source, "eval_data")
    data = checks.check(data, global_batch=local_batch * process_count, train=False,
                        process_index=process_index, process_count=process_count)
    return evalsets.eval_batches(data, local_batch=local_batch, process_index=process_index,
                                 process_count=process_count, max_batches=max_batches)


def num_eval_examples(source, max_batches: int, global_batch: int) -> int:
    n = len(source)
    return min(n, max_batches * global_batch) if max_batches else n


# Last: prepare.py is built from the functions above.
from jtrain.data.prepare import RunData, UserData, prepare  # noqa: E402,F401
