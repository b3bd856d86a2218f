"""What jtrain.data accepts (table-driven), its sharding / shuffling / split semantics,
and the bad inputs: each a one-line DataError (a ValueError) naming the dataset and the
item index or field, raised by the checks before training (exit 2 from the CLI)."""

import json
import sys
import types

import grain
import numpy as np
import pytest
import torch

import jtrain
from jtrain import config as config_lib
from jtrain import data as data_lib
from jtrain.losses import ROW_MASK
from jtrain import main as main_lib
from projects import bad_input_user

N = 24


def cfg_data(**over):
    over.setdefault("val_fraction", 0.0)
    over.setdefault("batch_size", 4)
    return config_lib.resolve({"data": over}).data


def batches(data, n=2, **kw):
    d = cfg_data(**kw)
    train, _, _ = data_lib.make_sources(d, data)
    it = data_lib.make_train_iterator(
        train, local_batch=d.batch_size, seed=0, shuffle=d.shuffle, process_index=0,
        process_count=1, drop_last=d.drop_last, num_threads=0)
    out = [next(it) for _ in range(n)]
    it.close()
    return out


# ---------------------------------------------------------------------------- datasets
class Items(bad_input_user.Items, torch.utils.data.Dataset):
    """Map-style; `make(i)` builds item i."""

    def __init__(self, make, n=N):
        super().__init__(make, n)


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, n=N, split_itself=False):
        self.n, self.split_itself = n, split_itself

    def __iter__(self):
        lo, step = 0, 1
        info = torch.utils.data.get_worker_info()
        if self.split_itself and info is not None:
            lo, step = info.id, info.num_workers
        for i in range(lo, self.n, step):
            yield torch.tensor([float(i), 1.0]), i


def pair_collate(items):  # a PyTorch-style collate_fn
    xs, ys = zip(*items, strict=True)
    return {"inputs": torch.stack(xs), "targets": torch.tensor(ys)}


def _grain_loader(batch=4, shard=(0, 1), epochs=None):
    src = [{"inputs": np.float32([i, 0]), "targets": np.int32(i)} for i in range(N)]
    return grain.DataLoader(
        data_source=src, operations=[grain.transforms.Batch(batch, drop_remainder=True)],
        sampler=grain.samplers.IndexSampler(N, shuffle=True, seed=0, num_epochs=epochs),
        shard_options=grain.sharding.ShardOptions(*shard))


x = np.arange(N * 2, dtype=np.float32).reshape(N, 2)
y = np.arange(N, dtype=np.int32)
ACCEPTED = {
    "arrays": lambda: (x, y),
    "arrays+weights": lambda: (x, y, np.ones(N, np.float32)),
    "dict of arrays": lambda: {"inputs": x, "targets": y},
    "torch tensor tuples": lambda: Items(lambda i: (torch.tensor([i, 1.0]), torch.tensor(i))),
    "torch dict items": lambda: Items(lambda i: {"inputs": torch.ones(2) * i, "targets": i}),
    "numpy and numbers": lambda: Items(lambda i: (np.float32([i, 0.5]), i)),
    "python lists": lambda: Items(lambda i: ([float(i), 0.0], i)),
    "nested inputs": lambda: Items(lambda i: {"inputs": {"a": np.ones(2) * i, "b": np.zeros(3)},
                                              "targets": i}),
    "list of items": lambda: [(np.float32([i, 0]), i) for i in range(N)],
    "torch iterable": lambda: Stream(),
    "torch iterable, self-split": lambda: Stream(split_itself=True),
    "torch DataLoader": lambda: torch.utils.data.DataLoader(
        Items(lambda i: (torch.tensor([i, 1.0]), i)), batch_size=4, shuffle=True),
    "DataLoader of a stream": lambda: torch.utils.data.DataLoader(Stream(), batch_size=4),
    "DataLoader + collate_fn": lambda: torch.utils.data.DataLoader(
        Items(lambda i: (torch.tensor([i, 1.0]), i)), batch_size=4, collate_fn=pair_collate),
    "grain MapDataset": lambda: grain.MapDataset.range(N).map(
        lambda i: {"inputs": np.float32([i, 0]), "targets": np.int32(i)}),
    "grain IterDataset": lambda: grain.MapDataset.range(N).map(
        lambda i: {"inputs": np.float32([i, 0]), "targets": np.int32(i)}).to_iter_dataset(),
    "grain DataLoader": _grain_loader,
}


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_accepted_inputs_give_numpy_batches(name):
    data = ACCEPTED[name]()
    if isinstance(data, torch.utils.data.DataLoader):
        d = cfg_data()
        data, _, _ = data_lib.load_user_data(d, data)
    b = batches(data)
    assert {"inputs", "targets"} <= set(b[0])
    for leaf in jtrain.data.items.flatten(b[0]):
        assert isinstance(leaf[1], np.ndarray) and leaf[1].shape[0] == 4, (name, leaf)
        assert leaf[1].dtype.itemsize <= 4  # 64-bit leaves become 32-bit, as on device
    assert b[0]["targets"].dtype.kind == "i"
    # Each input is paired with its own target: every kind above encodes the example's
    # index in the first input value (2i for the arrays x) and as the target.
    scale = 2 if name in ("arrays", "arrays+weights", "dict of arrays") else 1
    for batch in b:
        first = jtrain.data.items.flatten(batch["inputs"])[0][1].reshape(4, -1)[:, 0]
        np.testing.assert_array_equal(first, scale * batch["targets"], err_msg=name)
    assert len({int(t) for batch in b for t in batch["targets"]}) > 1, name  # not constant


def test_dataloader_settings_become_data_config():
    loader = torch.utils.data.DataLoader(Items(lambda i: (torch.ones(2), i)), batch_size=6,
                                         shuffle=False, drop_last=False, num_workers=2,
                                         prefetch_factor=3)
    d = cfg_data()
    data, _, overrides = data_lib.load_user_data(d, loader, process_count=2)
    assert d.batch_size == 4  # the config given is not changed; a new one is built
    d = cfg_data(**{**d.to_dict(), **overrides})
    assert (d.batch_size, d.shuffle, d.drop_last, d.num_workers, d.prefetch) == (
        12, False, False, 2, 3)
    train, _, info = data_lib.make_sources(d, data, process_count=2)
    assert "from a torch DataLoader: batch_size=6 per process" in info["notes"][0]


@pytest.mark.parametrize("kind", ["map", "stream", "self-split stream"])
def test_processes_read_disjoint_shards_covering_the_epoch(kind):
    per_process = []
    for p in range(2):
        d = cfg_data(batch_size=8, shuffle=True)
        data = {"map": Items(lambda i: (np.float32([i]), i)), "stream": Stream(),
                "self-split stream": Stream(split_itself=True)}[kind]
        train, _, _ = data_lib.make_sources(d, data, process_index=p, process_count=2)
        it = data_lib.make_train_iterator(train, local_batch=4, seed=3, shuffle=True,
                                          process_index=p, process_count=2)
        per_process.append([int(t) for _ in range(N // 8) for t in next(it)["targets"]])
    a, b = map(set, per_process)
    assert not a & b and sorted(a | b) == list(range(N))


def test_epochs_reshuffle_from_seed_and_epoch():
    def order(seed):
        d = cfg_data(batch_size=8)
        train, _, _ = data_lib.make_sources(d, (x, y))
        it = data_lib.make_train_iterator(train, local_batch=8, seed=seed, shuffle=True,
                                          process_index=0, process_count=1)
        return [tuple(next(it)["targets"]) for _ in range(6)]  # 2 epochs of 3 batches

    a = order(0)
    assert sorted(sum(a[:3], ())) == list(range(N)) == sorted(sum(a[3:], ()))
    assert a[:3] != a[3:] and a == order(0) and a != order(1)


def test_val_fraction_holds_out_a_fixed_part():
    splits = []
    for seed in (0, 1):  # the run's seed does not move the split; data.split_seed does
        d = config_lib.resolve({"seed": seed, "data": {"val_fraction": 0.25,
                                                       "batch_size": 4}}).data
        train, ev, info = data_lib.make_sources(d, (x, y))
        tr = {int(train.source.read(i)["targets"]) for i in range(len(train))}
        va = {int(ev.source.read(i)["targets"]) for i in range(len(ev))}
        assert len(va) == 6 and not tr & va and len(tr | va) == N
        splits.append(va)
    assert splits[0] == splits[1]
    d = cfg_data(val_fraction=0.25)
    train, ev, _ = data_lib.make_sources(d, Stream(n=400))
    tr = [int(t) for b in [next(iter(data_lib.make_train_iterator(
        train, local_batch=4, seed=0, shuffle=False, process_index=0, process_count=1)))]
        for t in b["targets"]]
    held = {int(ev.source.read(i)[1]) for i in range(ev.source.num_valid)}
    assert 60 < len(held) < 140 and not set(tr) & held


def test_random_transforms_and_global_rng_are_seeded_per_item():
    def jitter(item, rng):
        return item[0] + rng.normal(size=2).astype(np.float32), item[1]

    def first_epochs(data, seed=0):
        d = cfg_data(batch_size=8)
        train, _, _ = data_lib.make_sources(d, data)
        it = data_lib.make_train_iterator(train, local_batch=8, seed=seed, shuffle=True,
                                          process_index=0, process_count=1)
        return np.concatenate([next(it)["inputs"] for _ in range(6)])

    plain = Items(lambda i: (np.float32([i, i]), i))
    a = first_epochs(data_lib.with_transform(plain, jitter))
    np.testing.assert_array_equal(a, first_epochs(data_lib.with_transform(plain, jitter)))
    assert not np.array_equal(a[:24], a[24:])  # epoch 1 draws new noise
    assert not np.array_equal(a, first_epochs(data_lib.with_transform(plain, jitter), seed=1))

    torch_rng = Items(lambda i: (torch.rand(2) + i, i))
    b = first_epochs(torch_rng)
    torch.rand(5)  # the user's global RNG moves: jtrain's items do not
    np.testing.assert_array_equal(b, first_epochs(torch_rng))
    # The run's header line (one per run, not a logging record the console may not show).
    _, _, info = data_lib.make_sources(cfg_data(batch_size=8), torch_rng)
    assert len(info["warnings"]) == 1 and "torch's global RNG" in info["warnings"][0]
    assert data_lib.make_sources(cfg_data(batch_size=8), plain)[2]["warnings"] == []


def test_batches_per_epoch_estimate():
    _, _, info = data_lib.make_sources(cfg_data(batch_size=5), (x, y))
    assert info["batches_per_epoch"] == 4
    _, _, info = data_lib.make_sources(cfg_data(batch_size=5, drop_last=False), (x, y))
    assert info["batches_per_epoch"] == 5
    _, _, info = data_lib.make_sources(cfg_data(), Stream())
    assert info["batches_per_epoch"] is None  # a stream without __len__: unknown


# ------------------------------------------------------------------ data.source factories
def make_pairs(n, scale=1.0):
    xs = np.arange(n * 2, dtype=np.float32).reshape(n, 2) * scale
    return {"train": (xs, np.arange(n, dtype=np.int32)), "eval": (xs[:5], np.zeros(5, np.int32))}


def shift(item, rng):
    return {"inputs": item["inputs"] + rng.integers(1, 3), "targets": item["targets"]}


def test_config_names_a_factory_and_a_transform_by_import_path():
    module = types.ModuleType("jtrain_test_factories")
    module.make_pairs, module.shift = make_pairs, shift
    sys.modules[module.__name__] = module
    d = cfg_data(source="jtrain_test_factories:make_pairs", kwargs={"n": 40, "scale": 2.0})
    train, ev, info = data_lib.make_sources(d)
    assert len(train) == 40 and len(ev) == 5 and train[1]["inputs"].tolist() == [4.0, 6.0]
    d = cfg_data(source="jtrain_test_factories:make_pairs", kwargs={"n": 40},
                 transform="jtrain_test_factories:shift", shuffle=False)
    train, _, info = data_lib.make_sources(d)
    assert "random transform shift(item, rng)" in info["notes"]
    it = data_lib.make_train_iterator(train, local_batch=4, seed=0, shuffle=False,
                                      process_index=0, process_count=1)
    moved = next(it)["inputs"] - np.arange(8, dtype=np.float32).reshape(4, 2)
    assert set(moved.ravel().tolist()) <= {1.0, 2.0}


# ----------------------------------------------------------------------------- bad inputs
class LyingLen(torch.utils.data.Dataset):
    def __len__(self):
        return 20

    def __getitem__(self, i):
        if i >= 15:
            raise IndexError("index out of range")
        return np.float32([i]), i


def _items(n, bad_at, bad):
    return Items(lambda i: bad if i == bad_at else {"inputs": np.float32([i, 0]),
                                                    "targets": np.int32(i)}, n)


BAD = [  # (data, config overrides, the error must contain)
    (Items(lambda i: (i, i), 0), {}, "train_data: the dataset is empty"),
    ((x[:3], y[:3]), {"batch_size": 8}, "train_data: 3 examples is fewer than one global batch"),
    (_items(24, 12, {"inputs": np.float32([1, 0])}), {}, "train_data[12]: fields"),
    (_items(24, 6, {"inputs": np.float32([1, 0, 0]), "targets": np.int32(1)}), {},
     "train_data[6].inputs: shape (3,) differs from item 0's (2,)"),
    (_items(24, 23, {"inputs": np.float32([1, 0]), "targets": np.float32(1)}), {},
     "train_data[23].targets: dtype float32 differs from item 0's int32"),
    (LyingLen(), {}, "train_data: __len__ says 20 but item 15 raises IndexError"),
    (Items(lambda i: ("text", i)), {}, "train_data[0].inputs: <U4 values (str) cannot go to"),
    (Items(lambda i: (1, 2, 3, 4)), {}, "train_data[0]: a tuple item must be"),
    (Items(lambda i: {}), {}, "train_data[0]: an empty dict item"),
    (Items(lambda i: 1 / 0), {}, "train_data[0]: ZeroDivisionError: division by zero"),
    (x, {}, "train_data: a bare array has no targets"),
    (42, {}, "train_data: unsupported data of type int"),
    ((i for i in range(3)), {}, "train_data: an iterator or generator can be read only once"),
    (Stream(n=0), {}, "train_data: the stream is empty"),
    (Stream(n=3), {}, "train_data: the stream has 3 examples, fewer than one batch of 4"),
    (torch.utils.data.DataLoader(Items(lambda i: (np.ones(1), i)), batch_size=4,
                                 sampler=torch.utils.data.WeightedRandomSampler([1.0] * N, N)),
     {}, "train_data: sampler WeightedRandomSampler cannot be honoured"),
    (torch.utils.data.DataLoader(Items(lambda i: (np.ones(1), i)), batch_size=4,
                                 sampler=torch.utils.data.RandomSampler(range(N), num_samples=8)),
     {}, "train_data: a RandomSampler with replacement or num_samples cannot be honoured"),
    (torch.utils.data.DataLoader(Items(lambda i: (np.ones(1), i)), batch_size=None), {},
     "train_data: a DataLoader with batch_size=None"),
    (torch.utils.data.DataLoader(Items(lambda i: (torch.ones(1 + i // 20), i)),
                                 batch_size=4, collate_fn=lambda b: {
                                     "inputs": torch.nn.utils.rnn.pad_sequence(
                                         [t for t, _ in b], batch_first=True),
                                     "targets": torch.tensor([t for _, t in b])}), {},
     "train_data[20..23] (collate_fn).inputs: shape (2,) differs from the first batch's (1,)"),
    (torch.utils.data.DataLoader(Items(lambda i: (torch.ones(2), i)), batch_size=4,
                                 collate_fn=lambda b: {"inputs": torch.ones(3, 2),
                                                       "targets": torch.zeros(4)}), {},
     "train_data[0..3] (collate_fn).inputs: leading dim of shape (3, 2) is not the batch"),
    (_grain_loader(shard=(0, 2)), {}, "train_data: the grain DataLoader reads shard 0 of 2"),
    (_grain_loader(batch=3), {}, "train_data: the grain DataLoader's batches do not have"),
    (None, {"source": "no_such_module_xyz:make"},
     "data.source: cannot import 'no_such_module_xyz'"),
    (None, {"source": "json:no_such_factory"}, "data.source: 'json' has no attribute"),
    (None, {"source": "json:dumps"}, "data.source: json:dumps(**data.kwargs): TypeError"),
]


@pytest.mark.parametrize("data,over,message", BAD, ids=[m.split(":")[1][:40] for _, _, m in BAD])
def test_bad_inputs_fail_in_one_line_before_training(data, over, message):
    d = cfg_data(**over)
    with pytest.raises(data_lib.DataError) as e:
        train, ev, _ = data_lib.load_user_data(d, data)
        data_lib.make_sources(d, train, ev)
    assert isinstance(e.value, ValueError)
    text = str(e.value)
    assert message in text and "\n" not in text, text


def test_bad_eval_data_and_late_bad_items():
    with pytest.raises(data_lib.DataError, match="eval_data: the dataset is empty"):
        data_lib.make_sources(cfg_data(), (x, y), Items(lambda i: (i, i), 0))
    # An item that differs but is not among those probed fails when its batch is made,
    # named by its index.
    d = cfg_data(shuffle=False)
    train, _, _ = data_lib.make_sources(d, _items(24, 9, {"inputs": np.float32([1, 0, 0]),
                                                          "targets": np.int32(1)}))
    it = data_lib.make_train_iterator(train, local_batch=4, seed=0, shuffle=False,
                                      process_index=0, process_count=1)
    next(it), next(it)
    with pytest.raises(data_lib.DataError, match=r"train_data\[9\].inputs: shape"):
        next(it)


def test_library_and_cli_report_data_errors_before_any_step(tmp_path, capsys):
    with pytest.raises(jtrain.DataError, match="train_data: the dataset is empty"):
        jtrain.train({"total_steps": 5, "data": {"batch_size": 8}}, str(tmp_path / "lib"),
                     model=(lambda rng, x: {}, lambda p, x: x), train_data=(x[:0], y[:0]))
    assert not (tmp_path / "lib" / "checkpoints").exists()
    with pytest.raises(SystemExit) as e:
        main_lib.cli(["jtrain", "--config=configs/base.py:debug", f"--workdir={tmp_path}/cli",
                      "--config.data.source=no_such_module_xyz:make"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("jtrain: data error: data.source: cannot import"), err
    assert json.dumps(err)  # one line each, no traceback
    assert not any("Traceback" in line for line in err)


def test_stream_eval_set_over_two_processes_agrees_through_the_gather_it_is_given():
    """The data layer calls no collective: the row counts of a stream eval set travel
    through the `gather` the caller passes (jtrain.mesh.process_values in training).
    Two simulated processes: every example once, the same padded batch count."""
    d = cfg_data()
    stream = data_lib.load.as_data(Stream(9), "eval_data")
    # each process reads its shard; the gather answers for both
    counts = {p: len(stream.local_rows(p, 2, workers=1, limit=None)) for p in (0, 1)}
    seen, sizes = [], set()
    for p in (0, 1):
        _, ev, _ = data_lib.make_sources(d, Stream(16), Stream(9), process_index=p,
                                         process_count=2, gather=lambda n: [counts[0], counts[1]])
        batches_ = list(data_lib.eval_batches(ev, local_batch=2, process_index=p,
                                              process_count=2))
        sizes.add(len(batches_))
        for b in batches_:
            seen += [int(t) for t, m in zip(b["targets"], b[ROW_MASK], strict=True) if m]
    assert sorted(seen) == list(range(9)) and len(sizes) == 1
    with pytest.raises(ValueError, match="gather"):
        data_lib.make_sources(d, Stream(16), Stream(9), process_index=0, process_count=2)
