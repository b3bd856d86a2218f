"""BatchNorm's running statistics on 8 devices (the suite's 8-device child): each step's
statistics are those of the global batch (the mean over the data-parallel devices), so
they equal the numpy recomputation and the 1-device run, and eval uses them. Under
determinism.topology_invariant each chunk normalises with its own statistics and the
chunks' running statistics are averaged in a fixed order: the same bits on 1 and 8
devices, equal to numpy's chunk by chunk recomputation."""

import json

import jax
import numpy as np
import pytest

import jtrain
from jtrain import mesh as mesh_lib
from jtrain import state as state_lib
from test_model_state import BATCH, MOMENTUM, NnxNet, check_statistics_and_eval, data
from test_model_state import stats_of

pytestmark = pytest.mark.multidevice

MAKE_MESH = mesh_lib.make_mesh
CHUNKS, ACCUM = 8, 1  # accumulation's scan would hide a hoisted update: one microbatch


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_running_statistics_on_8_devices(tmp_path, kind):
    assert jax.device_count() == 8
    check_statistics_and_eval(tmp_path, kind)


def chunked_stats(workdir, x):
    """numpy's running statistics under the mode: per step, each chunk of consecutive
    rows starts from the step's statistics and moves them once per microbatch (rows j,
    j + ACCUM, ... of the chunk); the step's result is the chunks' mean."""
    with open(workdir / "hashes.jsonl") as f:
        rows = sorted((json.loads(line) for line in f), key=lambda r: r["step"])
    mean, var = np.zeros(4), np.ones(4)
    for r in rows:
        batch = x[r["examples"]].astype(np.float64)
        assert len(batch) == BATCH
        means, variances = [], []
        for chunk in np.split(batch, CHUNKS):
            m, v = mean, var
            for j in range(ACCUM):
                micro = chunk[j::ACCUM]
                m = MOMENTUM * m + (1 - MOMENTUM) * micro.mean(0)
                v = MOMENTUM * v + (1 - MOMENTUM) * micro.var(0)
            means.append(m)
            variances.append(v)
        mean, var = np.mean(means, 0), np.mean(variances, 0)
    return mean, var


def test_topology_invariant_statistics_same_bits_on_1_and_8_devices(tmp_path, monkeypatch):
    train = data()
    ev = data(BATCH, seed=1)
    runs = {}
    for n in (1, 8):
        monkeypatch.setattr(mesh_lib, "make_mesh", lambda cfg=None, devices=None, n=n:
                            MAKE_MESH(cfg, devices=jax.devices()[:n]))
        cfg = {"seed": 0, "total_steps": 2, "data": {"batch_size": BATCH},
               "optim": {"lr": 0.05, "grad_accum_steps": ACCUM},
               "eval": {"every_steps": 2, "batch_size": BATCH},
               "checkpoint": {"every_steps": 0}, "compile": {"cache_dir": ""},
               "debug": {"hash_every_steps": 1}, "mesh": {"data": -1},
               "determinism": {"topology_invariant": True, "chunks": CHUNKS}}
        runs[n] = jtrain.train(cfg, str(tmp_path / str(n)), model=NnxNet, train_data=train,
                               eval_data=ev)
    one, eight = runs[1], runs[8]
    assert state_lib.state_sha256(one.state) == state_lib.state_sha256(eight.state)
    assert one.history[-1]["eval/loss"] == eight.history[-1]["eval/loss"]
    want_mean, want_var = chunked_stats(tmp_path / "8", train["inputs"])
    mean, var = stats_of("nnx", eight.state.model_state)
    np.testing.assert_allclose(mean, want_mean, rtol=1e-5)
    np.testing.assert_allclose(var, want_var, rtol=1e-5)
