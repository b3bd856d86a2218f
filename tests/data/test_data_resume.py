"""Exact data positions: an iterator checkpointed (get_state -> JSON) and restored at every
one of 50 steps continues with exactly the batches the uninterrupted iterator gives, for
a torch map-style dataset, a torch IterableDataset, arrays, a grain MapDataset and a grain
IterDataset; with 2 grain worker processes at a few restore points; and through the
background device prefetch (the saved position is the step's, not the read-ahead's)."""

import copy
import json
import threading

import grain
import jax
import numpy as np
import pytest
import torch

from jtrain import config as config_lib
from jtrain import data as data_lib
from jtrain import mesh as mesh_lib
from jtrain.data import streams
from jtrain.losses import ROW_MASK

STEPS = 50
N = 45  # not a multiple of the batch: epochs end mid-stream, partial batches dropped


class TorchMap(torch.utils.data.Dataset):
    """Items draw from torch's global RNG (like torchvision's random transforms)."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.full((3,), float(i)) + torch.rand(3), i


class TorchStream(torch.utils.data.IterableDataset):
    """A stream that reshuffles per epoch (set_epoch) and splits itself by worker info."""

    def __init__(self):
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        shard, shards = (info.id, info.num_workers) if info else (0, 1)
        order = np.random.default_rng(self.epoch).permutation(N)
        for i in order[shard::shards]:
            yield {"inputs": np.float32([i, torch.rand(()).item()]), "targets": np.int32(i)}


def _grain_item(i):
    return {"inputs": np.float32([i, i * 2]), "targets": np.int32(i)}


def make(kind):
    x = np.arange(N * 2, dtype=np.float32).reshape(N, 2)
    if kind == "arrays":
        return (x, np.arange(N, dtype=np.int32))
    if kind == "torch_map":
        return TorchMap()
    if kind == "torch_stream":
        return TorchStream()
    if kind == "grain_map":
        return grain.MapDataset.range(N).map(_grain_item)
    if kind == "grain_iter":
        return grain.MapDataset.range(N).map(_grain_item).to_iter_dataset(
            grain.ReadOptions(num_threads=0))
    raise ValueError(kind)


def iterator(kind, workers=0, batch=4, drop_last=True):
    cfg = config_lib.resolve({"data": {"batch_size": batch, "val_fraction": 0.0,
                                       "drop_last": drop_last}})
    train, _, _ = data_lib.make_sources(cfg.data, make(kind))
    return data_lib.make_train_iterator(train, local_batch=batch, seed=7, shuffle=True,
                                        process_index=0, process_count=1, num_workers=workers,
                                        drop_last=drop_last)


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert sorted(x) == sorted(y)
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


@pytest.mark.parametrize("kind", ["torch_map", "torch_stream", "arrays", "grain_map",
                                  "grain_iter"])
def test_restore_at_every_step_gives_the_same_stream(kind):
    it = iterator(kind)
    ref, states = [], [json.loads(json.dumps(it.get_state()))]
    for _ in range(STEPS):
        ref.append(next(it))
        states.append(json.loads(json.dumps(it.get_state())))
    it.close()
    # Several epochs were crossed (45 examples, batch 4).
    assert len({int(t) for b in ref for t in b["targets"]}) > 40
    for k in range(STEPS):
        resumed = iterator(kind)
        resumed.set_state(states[k])
        assert_same(take(resumed, STEPS - k), ref[k:])
        resumed.close()


@pytest.mark.slow  # two grain worker processes
def test_two_workers_map_style_position_does_not_depend_on_worker_count():
    """One 2-worker pipeline (worker start-up costs seconds): restored from a 0-worker
    position at step 9, and its own position at step 17 restored without workers."""
    ref_it = iterator("torch_map")
    states, ref = {}, []
    for k in range(24):
        states[k] = json.loads(json.dumps(ref_it.get_state()))
        ref.append(next(ref_it))
    two = iterator("torch_map", workers=2)
    two.set_state(states[9])
    assert_same(take(two, 8), ref[9:17])
    state17 = json.loads(json.dumps(two.get_state()))
    two.close()
    assert state17 == states[17]
    zero = iterator("torch_map")
    zero.set_state(state17)
    assert_same(take(zero, 7), ref[17:])


def _two_worker_stream(n):
    """What 2 grain workers give for the stream, computed in this process: worker w reads
    shard w of 2 and batches come round-robin; with each step's position."""
    it = iterator("torch_stream", workers=2)
    shards = []
    for w in range(2):
        ds = copy.copy(it.batches)
        ds.set_slice(slice(w, None, 2))
        shards.append(iter(ds))
    batches, states = [], [it.get_state()]
    for k in range(n):
        batch = next(shards[k % 2])
        it.shards[k % 2] = batch.pop(streams.POSITION)["state"]
        it.consumed += 1
        batches.append(batch)
        states.append(json.loads(json.dumps(it.get_state())))
    return batches, states


@pytest.mark.slow  # two grain worker processes
def test_two_workers_stream_restores_exactly():
    ref, states = _two_worker_stream(20)
    two = iterator("torch_stream", workers=2)  # worker processes, from step 9's position
    two.set_state(states[9])
    assert_same(take(two, 11), ref[9:])
    assert two.get_state() == states[20]
    two.close()
    with pytest.raises(data_lib.DataError, match="data.num_workers"):
        iterator("torch_stream", workers=0).set_state(states[9])


def test_padded_last_batch_keeps_every_example_with_a_mask():
    it = iterator("arrays", batch=4, drop_last=False)
    epoch = take(it, 12)  # ceil(45 / 4) = 12 batches
    masks = np.concatenate([b[ROW_MASK] for b in epoch])
    targets = np.concatenate([b["targets"] for b in epoch])
    assert masks.sum() == N and masks[-3:].tolist() == [0, 0, 0]
    assert sorted(targets[masks == 1].tolist()) == list(range(N))
    assert ROW_MASK in next(it)  # every batch has the same fields


class Reads:
    """A host iterator that counts the batches read from it (by the prefetch thread)."""

    def __init__(self, host):
        self.host, self.reads, self.cond = host, 0, threading.Condition()

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.host)
        with self.cond:
            self.reads += 1
            self.cond.notify_all()
        return batch

    def wait_for(self, n, timeout=60.0) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.reads >= n, timeout)

    def get_state(self):
        return self.host.get_state()

    def set_state(self, state):
        self.host.set_state(state)

    def close(self):
        self.host.close()


def test_device_prefetch_saves_the_steps_position_not_the_read_ahead():
    mesh = mesh_lib.make_mesh(config_lib.resolve(None).mesh)
    put = lambda b: mesh_lib.host_to_device(b, mesh)  # noqa: E731
    ref = [jax.device_get(put(b)) for b in take(iterator("arrays", batch=8), 20)]
    host = Reads(iterator("arrays", batch=8))
    it = data_lib.device_prefetch(host, put, depth=3)
    got = [jax.device_get(next(it)) for _ in range(7)]
    # The thread refills its queue: 7 consumed + 3 queued have been read from the host.
    assert host.wait_for(7 + 3), f"the prefetch thread read only {host.reads} batches"
    assert host.get_state()["position"] >= 10  # the host iterator is ahead of the step
    state = json.loads(json.dumps(it.get_state()))
    assert state["position"] == 7  # the step's position, not the read-ahead's
    it.close()
    resumed = data_lib.device_prefetch(iterator("arrays", batch=8), put, depth=3)
    resumed.set_state(state)
    got += [jax.device_get(next(resumed)) for _ in range(13)]
    resumed.close()
    assert_same(got, ref)
    assert isinstance(got[0]["inputs"], np.ndarray)


def test_a_position_from_other_data_settings_is_refused():
    it = iterator("arrays", batch=4)
    next(it)
    state = it.get_state()
    other = iterator("arrays", batch=8)
    with pytest.raises(data_lib.DataError, match="global batch 4"):
        other.set_state(state)
    stream = iterator("torch_stream")
    with pytest.raises(data_lib.DataError, match="not one of a stream"):
        stream.set_state(state)


def test_seed_domains_never_collide_across_shards():
    """Every (domain, shard) pair gives its own seeds: shard 4 of the per-element stream
    RNG once shared a seed with the hold-out split."""
    from jtrain.data import sources

    domains = (sources.DOMAIN_ITEM, sources.DOMAIN_GLOBAL_RNG, sources.DOMAIN_WORKER,
               sources.DOMAIN_STREAM, sources.DOMAIN_HOLDOUT)
    assert len(set(domains)) == len(domains)
    seen = {}
    for domain in domains:
        for shard in range(64):
            for epoch in range(3):
                for index in range(4):
                    s = sources.item_seed(7, epoch, index, domain, shard)
                    assert s not in seen, (seen[s], (domain, shard, epoch, index))
                    seen[s] = (domain, shard, epoch, index)
