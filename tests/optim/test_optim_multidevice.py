"""Weight EMA, schedule-free AdamW and the state hashes on 8 fake devices (mesh.fsdp=8):
the losses are a 1-device run's to float reduction order, the EMA (and the optimizer's
per-parameter state) is sharded exactly like the params, and a run killed by SIGTERM
and resumed on the same mesh writes the same hashes.jsonl, byte for byte, as the run
that went straight through. Three short runs in the suite's 8-device child, shared by
the tests below."""

import functools
import os

import jax
import numpy as np
import pytest

import jtrain
from jtrain import diff
from jtrain import mesh as mesh_lib
from jtrain.control import faults
from journey import metric_by_step

pytestmark = pytest.mark.multidevice

STEPS = 6


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 16)).astype(np.float32)
    return x, (x[:, :8].sum(1) > x[:, 8:].sum(1)).astype(np.int32)


def _config(fsdp):
    return {"seed": 0, "total_steps": STEPS,
            "model": {"name": "mlp", "hidden": (32, 32), "num_outputs": 2},
            "data": {"batch_size": 16}, "mesh": {"fsdp": fsdp},
            "optim": {"name": "schedule_free_adamw", "lr": 1e-2, "schedule": "constant",
                      "ema": {"decay": 0.9}},
            "eval": {"every_steps": 0, "num_batches": 1},
            "checkpoint": {"every_steps": 3},
            "log": {"every_steps": 1, "writers": ("jsonl",)},
            "debug": {"hash_every_steps": 1}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """fsdp=8 straight through; fsdp=8 stopped by SIGTERM after its 2nd step and resumed;
    the same run on one device (a mesh of the first device only)."""
    assert jax.device_count() == 8
    base = tmp_path_factory.mktemp("runs")
    out = {"straight": str(base / "straight"), "resumed": str(base / "resumed"),
           "one": str(base / "one")}
    out["state"] = jtrain.train(_config(8), out["straight"], train_data=_data()).state
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(faults.FAULT_ENV, "step:2:TERM")
        stopped = jtrain.train(_config(8), out["resumed"], train_data=_data())
    out["stopped"] = stopped.summary
    out["resumed_summary"] = jtrain.train(_config(8), out["resumed"],
                                          train_data=_data()).summary
    with pytest.MonkeyPatch.context() as mp:
        one = functools.partial(mesh_lib.make_mesh, devices=jax.devices()[:1])
        mp.setattr(mesh_lib, "make_mesh", one)
        out["one_state"] = jtrain.train(_config(1), out["one"], train_data=_data()).state
    return out


def test_fsdp8_losses_match_one_device(runs):
    assert runs["one_state"].params["dense_0"]["kernel"].sharding.mesh.size == 1
    eight, one = metric_by_step(runs["straight"]), metric_by_step(runs["one"])
    assert sorted(eight) == sorted(one) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([eight[s] for s in one], [one[s] for s in one],
                               rtol=1e-5, atol=1e-6)
    for name in ("params", "ema"):  # the end states too, leaf by leaf
        jax.tree.map(lambda a, b: np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6),
            getattr(runs["state"], name), getattr(runs["one_state"], name))


def test_ema_and_optimizer_state_are_sharded_like_the_params(runs):
    state = runs["state"]
    params = jax.tree_util.tree_flatten_with_path(state.params)[0]
    ema = dict(jax.tree_util.tree_flatten_with_path(state.ema)[0])
    assert len(ema) == len(params) == 6
    specs = set()
    for path, p in params:
        assert ema[path].sharding == p.sharding, jax.tree_util.keystr(path)
        assert ema[path].sharding.mesh.shape["fsdp"] == 8
        specs.add(tuple(p.sharding.spec))
    assert any("fsdp" in spec for spec in specs), specs  # really sharded, not replicated
    sf = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda x: hasattr(x, "z"))
          if hasattr(s, "z")][0]  # schedule-free's z: sharded like the params too
    for (path, p), z in zip(params, jax.tree.leaves(sf.z), strict=True):
        assert z.sharding == p.sharding, jax.tree_util.keystr(path)


def test_sigterm_and_resume_on_8_devices_write_the_same_hashes(runs):
    assert runs["stopped"]["stopped_by"] == "SIGTERM"
    assert 2 <= runs["stopped"]["step"] < STEPS
    assert runs["resumed_summary"]["resumed_from"] == runs["stopped"]["step"]
    straight = open(os.path.join(runs["straight"], "hashes.jsonl")).read()
    assert len(straight.splitlines()) == STEPS
    assert open(os.path.join(runs["resumed"], "hashes.jsonl")).read() == straight
    assert diff.diff_runs(runs["straight"], runs["resumed"])["identical"]
