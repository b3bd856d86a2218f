"""The one hand-off between a run and its data.

Two moments, one object each:

    UserData   what the user passed (or `data.source` names), opened before the config
               is resolved: `settings(data_cfg)` is handed to `config.resolve`, calls the
               factory and reads a torch DataLoader's batch size, shuffle, drop_last,
               workers and prefetch, which become `data.*` in that one resolution
               (recorded as decided: `{"data.batch_size": {"value": 32, "from":
               "DataLoader"}}`).
    RunData    `prepare(...)`'s result for the resolved config: the checked train and
               eval sources, the dataset info, example 0 (for the model's sample and
               the checks), the vocabulary check, the eval plan (source and local batch)
               and `train_iterator(...)`, the endless batches at the restored position
               with the device prefetch in front.

Knows nothing about devices: the host-to-device transfer is the `put` the caller hands
to `train_iterator` (jtrain.mesh.host_to_device).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jtrain.data import load_user_data, make_sources, check_vocab, make_train_iterator
from jtrain.data import device_prefetch, example_indices, load, torch_adapters
from jtrain.data import mixture as mixture_lib, tokens
from jtrain.data.dataset import Data
from jtrain.data.items import DataError
from jtrain.errors import ConfigError
from jtrain.data.sources import dataset_indices
from jtrain.data.prefetch import DevicePrefetch


class UserData:
    """The user's train / eval data (or None: data.source or data.name), opened once.
    `processes()` -> (process index, process count), asked only when needed (a
    DataLoader's batch is per process), so that nothing starts the JAX backend before
    the run has set its XLA flags."""

    def __init__(self, train_data=None, eval_data=None, *,
                 processes: Callable[[], tuple[int, int]] = lambda: (0, 1)):
        self.train, self.eval = train_data, eval_data
        self.processes = processes
        self.decided: dict[str, dict] = {}  # data.* a DataLoader set: run.json records it
        self._opened = False

    def settings(self, data_cfg) -> dict:
        """Calls the data.source factory and reads a torch DataLoader; returns the
        `data.*` overrides its settings make (for `config.resolve(data_settings=...)`)."""
        self._opened, overrides = True, {}
        if self.train is None and data_cfg.source:
            self.train, factory_eval = load.from_factory(data_cfg)
            self.eval = factory_eval if self.eval is None else self.eval
        if any(map(torch_adapters.is_dataloader, (self.train, self.eval))):
            index, count = self.processes()
            self.train, self.eval, overrides = load_user_data(
                data_cfg, self.train, self.eval, process_index=index, process_count=count)
        self.decided = {f"data.{k}": {"value": v, "from": "DataLoader"}
                        for k, v in overrides.items()}
        if self.train is None and data_cfg.name == "tokens" and not data_cfg.mixture:
            named = tokens.tokenizer_name(data_cfg.path)  # None: make_tokens says why
            if named is not None and data_cfg.tokenizer not in ("", named):
                raise DataError("data.tokenizer", f"{data_cfg.tokenizer!r}, but the shards "
                                f"in {data_cfg.path} were made with {named!r}")
            if named is not None:
                overrides = {**overrides, "tokenizer": named}
        return overrides


@dataclasses.dataclass
class RunData:
    """A run's data, checked: what the set-up, the loop and the evaluations read."""
    train: Data
    eval: Data | None
    info: dict  # name, kind, sizes, batches_per_epoch, notes (the header), fingerprint
    train_example: dict  # train[0] as the model sees it
    example: dict  # eval[0], else train[0]: its targets shape the eval metrics
    eval_batch: int  # this process's eval batch
    decided: dict  # data.* settings a DataLoader made (run.json's "decided")
    eval_parts: dict = dataclasses.field(default_factory=dict)  # a mixture's components'
    # eval sets, each evaluated on its own as eval/<component>/<metric>
    _data_cfg: Any = dataclasses.field(repr=False, default=None)
    _seed: int = 0
    _process: tuple[int, int] = (0, 1)

    @property
    def byte_level(self) -> bool:
        """The built-in byte corpus or byte tokens: its eval reports bits per byte."""
        return self.info.get("name") == "pystdlib" or bool(self.info.get("byte_level"))

    def train_iterator(self, data_state: dict | None, put: Callable,
                       ) -> DevicePrefetch:
        """Endless per-process batches from `data_state` (a checkpoint's position; None:
        the start), `put` (the host-to-device transfer) applied data.device_prefetch
        batches ahead in a thread; `get_state()` is the position of the next step's
        batch."""
        d, (index, count) = self._data_cfg, self._process
        it = make_train_iterator(
            self.train, local_batch=d.batch_size // count, seed=self._seed,
            shuffle=d.shuffle, process_index=index, process_count=count,
            num_workers=d.num_workers, drop_last=d.drop_last, prefetch=d.prefetch,
            num_threads=d.num_threads)
        if data_state is not None:
            it.set_state(data_state)
        return device_prefetch(it, put, d.device_prefetch)

    def mixture_report(self, data_state: dict) -> dict | None:
        """A mixture's components at `data_state` (summary.json's data.mixture: weight,
        size, draws, epochs); None for other data."""
        schedule = getattr(self.train, "schedule", None)
        return None if schedule is None else mixture_lib.report(data_state, schedule)

    def batch_positions(self, first_state: dict, first_step: int):
        """(batch_of(step), indices_of(batch)) from the iterator's position before step
        `first_step`: the global batch a step consumed and that batch's example indices
        (map-style data; None / [] for streams) in the dataset the user passed, for the
        skip ledger and hashes.jsonl."""
        position = first_state.get("position")

        def batch_of(step: int) -> int | None:
            return None if position is None else int(position) + step - first_step

        def indices_of(number: int):
            rows = example_indices(first_state, self._seed, number)
            return None if rows is None else dataset_indices(self.train.source, rows)

        return batch_of, indices_of


def prepare(data_cfg, user: UserData, *, seed: int, eval_batch_size: int = 0,
            model_cfg=None, gather: Callable | None = None, cache: str | None = None,
            ) -> RunData:
    """The run's data for the resolved `data_cfg`: sources made and checked (a DataError
    before any step), and with `model_cfg` (a built-in model) its vocab_size checked
    against the token ids. `eval_batch_size`: eval.batch_size (0: data.batch_size).
    `gather(n)`: n from every process (jtrain.mesh.process_values). `cache`: the run's
    workdir, where token shards on a bucket are fetched to."""
    index, count = user.processes()
    if not user._opened:  # noqa: SLF001 - the config was resolved without its settings
        user.settings(data_cfg)
        if user.decided:  # a DataLoader's (data.tokenizer is checked, not decided)
            raise DataError("train_data: a torch DataLoader's settings must reach the "
                            "config: resolve it with data_settings=UserData.settings")
    train, ev, info = make_sources(data_cfg, user.train, user.eval, process_index=index,
                                   process_count=count, gather=gather, cache=cache)
    if model_cfg is not None:
        tokenizer_vocab = info.get("vocab_size")
        if tokenizer_vocab and (model_cfg.get("vocab_size") or 0) < tokenizer_vocab:
            raise ConfigError("model.vocab_size", f"{model_cfg.get('vocab_size')} is below "
                              f"the vocab size of data.path's tokenizer ({tokenizer_vocab}); "
                              f"set model.vocab_size >= {tokenizer_vocab}")
        check_vocab(model_cfg, train)
    train_example = train[0]
    return RunData(train=train, eval=ev, info=info, train_example=train_example,
                   example=ev[0] if ev is not None else train_example,
                   eval_batch=(eval_batch_size or data_cfg.batch_size) // count,
                   decided=dict(user.decided), eval_parts=getattr(train, "eval_parts", {}),
                   _data_cfg=data_cfg, _seed=seed,
                   _process=(index, count))
