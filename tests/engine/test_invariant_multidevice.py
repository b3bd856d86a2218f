"""determinism.topology_invariant in one process with 8 fake devices: the same run on
meshes of 1, 2, 4 and 8 of them (data and fsdp axes) writes byte-identical hashes.jsonl
and ends in bitwise-equal states (state_sha256 and every leaf's bytes) and eval results
for a user's NNX model (a user's Linen model and a step of your own: on 1 and 8
devices); without the mode the same runs on 1 and 8 devices differ (the negative
control: the comparison can fail)."""

import jax
import numpy as np
import pytest

import jtrain
from jtrain import invariant
from jtrain import mesh as mesh_lib
from jtrain.errors import ConfigError
from projects import nnx_mlp
from projects.linen_classifier import Net
from test_own_step import data as own_data, make as own_step

pytestmark = pytest.mark.multidevice

MESHES = ((1, 1), (2, 1), (2, 2), (8, 1))  # (data, fsdp) sizes: 1, 2, 4, 8 devices
MAKE_MESH = mesh_lib.make_mesh


def _config(fsdp=1, on=True, steps=3, batch=16, chunks=8, cache="auto"):
    return {"total_steps": steps, "seed": 0, "data": {"batch_size": batch},
            "optim": {"name": "adamw", "lr": 3e-2, "clip_norm": 0.5, "weight_decay": 0.1},
            "mesh": {"data": -1, "fsdp": fsdp, "auto_shard": True,
                     "auto_shard_min_bytes": 0},
            "eval": {"every_steps": steps}, "checkpoint": {"every_steps": 0},
            "compile": {"cache_dir": cache}, "debug": {"hash_every_steps": 1},
            "determinism": {"topology_invariant": on, "chunks": chunks}}


def _train(tmp_path, monkeypatch, kind, data, fsdp, on=True):
    monkeypatch.setattr(mesh_lib, "make_mesh", lambda mesh_cfg=None, devices=None: MAKE_MESH(
        mesh_cfg, devices=jax.devices()[:data * fsdp]))
    workdir = str(tmp_path / f"{kind}_{data}x{fsdp}_{on}")
    if kind == "own":  # no compile cache: the one-device programs compiled once are moved
        #                 to the other devices (with the cache, each device loads its own)
        r = jtrain.train(_config(fsdp, on, cache=""), workdir, step=own_step(),
                         train_data=own_data(), eval_data=own_data(40, seed=1))
    else:
        model = nnx_mlp.make() if kind == "nnx" else Net(hidden=32)
        r = jtrain.train(_config(fsdp, on), workdir, model=model, train_data=nnx_mlp.data(64),
                         eval_data=nnx_mlp.data(40))
    state = jax.device_get((r.state.params, r.state.opt_state))
    hashes = open(f"{workdir}/hashes.jsonl").read()
    return ([np.asarray(x).tobytes() for x in jax.tree.leaves(state)], hashes,
            r.summary["state_sha256"], r.history[-1])


@pytest.mark.parametrize("kind", ["nnx", "linen", "own"])
def test_same_bits_on_1_2_4_8_devices(tmp_path, monkeypatch, kind):
    # The fsdp meshes (2, 4 devices) are the NNX model's; a Linen model differs from it in
    # how its variables are made, not in how the mode splits the step: 1 and 8 devices
    # cover it. A step of your own runs whole on every device: 1 and 8 devices cover it.
    meshes = MESHES if kind == "nnx" else (MESHES[0], MESHES[-1])
    runs = {m: _train(tmp_path, monkeypatch, kind, *m) for m in meshes}
    reference = runs[MESHES[0]]
    assert len(reference[1].splitlines()) == 3
    for m, run in runs.items():
        for what, got, want in zip(("state", "hashes.jsonl", "state_sha256", "eval"), run,
                                   reference, strict=True):
            assert got == want, f"{kind}: data x fsdp = {m}: {what} differs from 1 device"
    if kind != "nnx":
        return
    # The negative control: without the mode the device count shows in the bits.
    off = [_train(tmp_path, monkeypatch, kind, *m, on=False)[:3] for m in ((1, 1), (8, 1))]
    assert all(a != b for a, b in zip(*off, strict=True)), "the default step agreed"


def test_tree_sum_order():
    xs = [np.float32(v) for v in (1e8, 1.0, -1e8, 1.0, 3.0)]
    assert invariant.tree_sum(xs) == ((xs[0] + xs[1]) + (xs[2] + xs[3])) + xs[4]


@pytest.mark.parametrize("over,message", [
    ({"batch": 24, "chunks": 16}, "determinism.chunks: 16 does not divide data.batch_size=24"),
    ({"chunks": 4}, "determinism.chunks: 4 is not a multiple of the 8 devices"),
])
def test_chunks_must_fit(tmp_path, over, message):
    with pytest.raises(ConfigError) as e:
        jtrain.train(_config(**over), str(tmp_path), model=nnx_mlp.make(),
                     train_data=nnx_mlp.data(64))
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("axis", ["tensor", "expert"])
def test_not_implemented_one_line(tmp_path, axis):
    cfg = _config()
    cfg["mesh"] = {"data": 2, axis: 4}
    with pytest.raises(ConfigError, match=f"not implemented with mesh.{axis}=4"):
        jtrain.train(cfg, str(tmp_path / "t"), model=nnx_mlp.make(),
                     train_data=nnx_mlp.data(64))
