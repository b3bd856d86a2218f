"""Stream components in a mixture: drawn by weight, consumed in order (the k-th draw is
the stream's k-th element), resumed exactly, the same global batch on any number of
processes; re-iterated per epoch; refused where they cannot be exact."""

import grain
import numpy as np
import pytest
import torch

from jtrain import config as config_lib
from jtrain.data import Mixture, make_sources, make_train_iterator, mixture
from jtrain.errors import DataError

N = 13  # stream elements per epoch


class Stream(torch.utils.data.IterableDataset):
    """Element i of epoch e is 1000 + 100 * e + i (set_epoch, as torch users write)."""

    def __init__(self, n=N, passes=None):
        self.n, self.epoch, self.passes = n, 0, passes

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        if self.passes is not None:
            self.passes -= 1
            if self.passes < 0:
                return
        for i in range(self.n):
            yield {"inputs": np.float32([1000 + 100 * self.epoch + i]), "targets": np.int32(1)}


def _grain(n=7):
    items = [{"inputs": np.float32([-1 - i]), "targets": np.int32(0)} for i in range(n)]
    return grain.MapDataset.source(items).to_iter_dataset()


def _mix(**extra):
    arrays = {"inputs": np.arange(40, dtype=np.float32)[:, None],
              "targets": np.zeros(40, np.int32)}
    return Mixture({"a": arrays, "s": Stream(), **extra},
                   weights={"a": 0.6, "s": 0.4, **{k: 0.2 for k in extra}})


def _cfg(**data):
    return config_lib.resolve({"data": {"batch_size": 8, "val_fraction": 0.0, **data}}).data


def _iter(train, local=8, p=0, count=1):
    return make_train_iterator(train, local_batch=local, seed=1, shuffle=True,
                               process_index=p, process_count=count)


def _stream_value(k):  # the k-th element of the stream, epochs one after the other
    epoch, i = divmod(k, N)
    return 1000 + 100 * epoch + i


def test_draws_follow_the_weights_and_take_the_stream_in_order():
    train, _, info = make_sources(_cfg(), _mix())
    assert info["components"] == "mixture of 2: a (0.60, 40 examples), s (0.40, stream)"
    assert train.known_size is None and any("every process" in n for n in train.notes)
    it = _iter(train)
    values = np.concatenate([next(it)["inputs"][:, 0] for _ in range(60)])
    drawn = values[values >= 1000]
    n = values.size
    sd = np.sqrt(n * 0.4 * 0.6)
    assert abs(drawn.size - n * 0.4) <= 5 * sd + 1
    assert drawn.tolist() == [_stream_value(k) for k in range(drawn.size)]  # k-th = k-th
    state = it.get_state()
    assert state["draws"][1] == drawn.size and state["sizes"] == [40, "stream"]
    assert state["epochs"][1] == (drawn.size - 1) // N  # passes whose end was read
    block = mixture.report(state, train.schedule)
    assert block["s"]["size"] == "stream" and block["s"]["epochs"] == state["epochs"][1]


def test_resume_mid_run_gives_the_batches_of_an_uninterrupted_read():
    train, _, _ = make_sources(_cfg(), _mix(g=_grain()))  # a torch and a grain stream
    ref = _iter(train)
    want = [next(ref)["inputs"].copy() for _ in range(14)]  # several epochs of both
    for stop in (3, 9):
        part = _iter(train)
        for _ in range(stop):
            next(part)
        resumed = _iter(train)
        resumed.set_state(part.get_state())
        for w in want[stop:]:
            assert np.array_equal(next(resumed)["inputs"], w)
    bad = dict(part.get_state(), sizes=[40, "stream", 7])
    with pytest.raises(DataError, match="checkpoint's mixture"):
        _iter(train).set_state(bad)


def test_one_process_and_the_halves_of_two_give_the_same_global_batch():
    def train():  # each process has its own stream object (set_epoch changes it)
        return make_sources(_cfg(), _mix())[0]

    one = _iter(train())
    halves = [_iter(train(), local=4, p=p, count=2) for p in (0, 1)]
    for _ in range(10):
        whole = next(one)["inputs"]
        assert np.array_equal(whole, np.concatenate([next(h)["inputs"] for h in halves]))
    state = halves[0].get_state()
    assert state == halves[1].get_state() == one.get_state()
    elastic = _iter(train())  # 2 processes' position resumed on 1
    elastic.set_state(state)
    for _ in range(5):
        assert np.array_equal(next(elastic)["inputs"], next(one)["inputs"])


def test_a_stream_that_cannot_start_another_pass_fails_naming_the_component():
    arrays = {"inputs": np.zeros((40, 1), np.float32), "targets": np.zeros(40, np.int32)}
    # passes: one for the check at start-up, one for training; then it yields nothing
    train, _, _ = make_sources(_cfg(), Mixture({"a": arrays, "s": Stream(5, passes=2)}))
    it = _iter(train)
    with pytest.raises(DataError, match=r"data\.mixture\.s: the stream yielded no element "
                                        r"in epoch 1"):
        for _ in range(20):
            next(it)
    loader = torch.utils.data.DataLoader(Stream(), batch_size=4)  # over a stream
    train, _, _ = make_sources(_cfg(), Mixture({"a": arrays, "s": loader}))
    assert train.stream_parts and next(_iter(train))["inputs"].shape == (8, 1)
    gen = (x for x in [{"inputs": np.zeros(1, np.float32), "targets": np.int32(0)}])
    with pytest.raises(DataError, match=r"data\.mixture\.s: an iterator or generator"):
        make_sources(_cfg(), Mixture({"a": arrays, "s": gen}))
    docs = [np.arange(5, dtype=np.int32)] * 20
    with pytest.raises(DataError, match=r"data\.mixture\.s: data\.packing is implemented "
                                        r"for map-style documents"):
        make_sources(_cfg(packing="concat", seq_len=8), Mixture({"a": docs, "s": Stream()}))


def test_a_held_out_part_of_a_stream_component_is_its_eval_set():
    train, ev, _ = make_sources(_cfg(val_fraction=0.3), _mix())
    held = sorted(float(ev.source.read(i)["inputs"][0]) for i in range(len(ev.source))
                  if float(ev.source.read(i)["inputs"][0]) >= 1000)
    assert held and len(held) < N
    it = _iter(train)
    seen = {float(v) for _ in range(20) for v in next(it)["inputs"][:, 0] if v >= 1000}
    assert seen and not seen & set(held)
