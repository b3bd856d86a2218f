"""mesh.auto_shard and log.train_metrics on a mesh. A parameter the model did not
annotate is sharded over fsdp along its largest divisible dimension (above
mesh.auto_shard_min_bytes); annotated ones keep their annotation and are counted apart
("replicated (annotated)"); the header says the bytes per device, run.json records
them, and an axis that shards nothing is a warning.

All multidevice checks share one set of short runs in the suite's 8-device child: an
unannotated NNX model under fsdp=8 (weight EMA, state hashes, train/accuracy) straight
through, killed by SIGTERM and resumed (the same hashes.jsonl, byte for byte), its
checkpoint resumed under data=2 x fsdp=4 and on one device (elastic), and the same run
on one device (the same losses, params and EMA to float reduction order); and a Linen
model with an
annotated kernel under optim.frozen and the EMA on data=2 x fsdp=4 with two
microbatches and lr 0, whose train/accuracy is recomputed in numpy. LoRA's adapters
are checked on the set-up alone (jtrain.build's abstract state and shardings)."""

import functools
import json
import os
import re
import shutil
import types

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

from jtrain import mesh as mesh_lib
from jtrain.observe import header
from journey import metric_by_step
from numpy_metrics import accuracies

FAKE = types.SimpleNamespace(shape={"data": 1, "fsdp": 8, "expert": 1, "context": 1,
                                    "tensor": 1, "stage": 1})
MESH8 = AbstractMesh((1, 8, 1, 1, 1, 1), mesh_lib.MESH_AXES)


def test_the_largest_divisible_dimension_goes_on_fsdp():
    assert mesh_lib.auto_dims((12, 64), np.float32, FAKE, 0) == (None, "fsdp")
    assert mesh_lib.auto_dims((64, 12), np.float32, FAKE, 0) == ("fsdp", None)
    assert mesh_lib.auto_dims((16, 16), np.float32, FAKE, 0) == ("fsdp", None)  # tie: first
    assert mesh_lib.auto_dims((128, 3, 24), np.float32, FAKE, 0) == ("fsdp", None, None)
    assert mesh_lib.auto_dims((12, 6), np.float32, FAKE, 0) == ()  # nothing divides


def test_the_threshold_and_the_switch():
    assert mesh_lib.auto_dims((8, 128), np.float32, FAKE, 4096) == (None, "fsdp")  # 4 KiB
    assert mesh_lib.auto_dims((8, 127 + 1), np.float16, FAKE, 4096) == ()  # 2 KiB: small
    assert mesh_lib.auto_dims((8, 128), np.float32, FAKE, None) == ()  # off
    one = types.SimpleNamespace(shape={"data": 8, "fsdp": 1, "context": 1, "tensor": 1})
    assert mesh_lib.auto_dims((8, 128), np.float32, one, 0) == ()  # no fsdp axis
    assert mesh_lib.auto_shard_bytes({"auto_shard": False}) is None
    assert mesh_lib.auto_shard_bytes() == 4096


def _tree(**shapes):
    return {k: jax.ShapeDtypeStruct(s, np.float32) for k, s in shapes.items()}


def test_annotated_replicated_leaves_are_counted_apart_from_too_small_ones():
    """The layout of a tree with Linen annotations, read by logical_to_shardings: a small
    leaf annotated replicated is "annotated", never "too small"."""
    from flax import linen as nn

    abstract = _tree(big=(16, 64), odd=(12, 100), kept=(8, 8), keep_big=(64, 64), bias=(64,))
    annotated = {**abstract, "kept": nn.LogicallyPartitioned(abstract["kept"], (None, None)),
                 "keep_big": nn.LogicallyPartitioned(abstract["keep_big"], (None, "mlp"))}
    shardings = mesh_lib.logical_to_shardings(annotated, MESH8, auto_shard_min_bytes=1024)
    assert shardings["big"].spec == P(None, "fsdp") and shardings["odd"].spec == P()
    out = mesh_lib.layout(abstract, shardings, 1024)
    assert {k: out[k] for k in ("sharded", "annotated", "replicated", "small")} == {
        "sharded": 1, "annotated": 2, "replicated": 1, "small": 1}
    assert out["per_device_bytes"] == out["total_bytes"] - 16 * 64 * 4 * 7 // 8
    lines = header.sharding_lines({"auto_shard_min_bytes": 1024}, MESH8,
                                  types.SimpleNamespace(params=abstract, opt_state={}),
                                  types.SimpleNamespace(params=shardings, opt_state={}))
    assert ("(1 leaves sharded, 1 replicated, 2 replicated (annotated), 1 too small "
            "(< 1,024 bytes, mesh.auto_shard_min_bytes)); mesh.auto_shard on") in lines[0]
    assert len(lines) == 1  # fsdp shards something: no warning


def test_an_axis_that_shards_nothing_is_a_warning():
    abstract = _tree(w=(16, 64), b=(64,))
    shardings = {"w": NamedSharding(MESH8, P()), "b": NamedSharding(MESH8, P())}
    lines = header.sharding_lines({"auto_shard": False}, MESH8,
                                  types.SimpleNamespace(params=abstract, opt_state={}),
                                  types.SimpleNamespace(params=shardings, opt_state={}))
    assert "(0 leaves sharded, 2 replicated); mesh.auto_shard off" in lines[0]
    assert lines[1].startswith("jtrain: warning: mesh.fsdp=8 shards no parameter: its "
                               "devices hold copies; annotate parameters")


# -- the shared runs (8 fake devices) ---------------------------------------------------

X = np.random.default_rng(0).normal(size=(96, 32)).astype(np.float32)
Y = ((X[:, 0] > 0).astype(np.int32) + 2 * (X[:, 1] > 0)).astype(np.int32)
DATA = [{"inputs": a, "targets": b} for a, b in zip(X, Y, strict=True)]
STEPS = 4


def _mlp():
    from flax import nnx

    class Mlp(nnx.Module):  # no annotations
        def __init__(self, rngs):
            self.hidden = nnx.Linear(32, 64, rngs=rngs)
            self.out = nnx.Linear(64, 4, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.hidden(x)))

    return Mlp


def _net():
    from flax import linen as nn

    class Net(nn.Module):  # one kernel annotated replicated: it must stay so
        @nn.compact
        def __call__(self, x, train=False):
            h = nn.relu(nn.Dense(256)(x))
            h = nn.relu(nn.Dense(64, kernel_init=nn.with_logical_partitioning(
                nn.initializers.lecun_normal(), (None, None)), name="kept")(h))
            return nn.Dense(4)(h)

    return Net()


def _nnx_config(**mesh):
    return {"total_steps": STEPS, "data": {"batch_size": 16, "shuffle": False},
            "mesh": {"data": -1, "auto_shard_min_bytes": 0, **mesh},
            "optim": {"lr": 1e-2, "ema": {"decay": 0.9}},
            "eval": {"every_steps": 0, "num_batches": 1},
            "checkpoint": {"every_steps": 2}, "debug": {"hash_every_steps": 1},
            "log": {"every_steps": 1, "writers": ["jsonl"], "train_metrics": ["accuracy"]}}


LINEN_CONFIG = {
    "total_steps": 2, "data": {"batch_size": 16, "shuffle": False},
    "mesh": {"data": 2, "fsdp": 4},  # the default threshold: 4 KiB
    # lr 0: the params stay the initial ones, so each batch's outputs are recomputable
    "optim": {"lr": 0.0, "grad_accum_steps": 2, "ema": {"decay": 0.9},
              "frozen": ["Dense_0"]},
    "eval": {"every_steps": 0, "num_batches": 1, "top_k": 2},
    "log": {"every_steps": 1, "writers": ["jsonl"],
            "train_metrics": ["accuracy", "top_k_accuracy"]}}


def _train(workdir, cfg, model, devices=None, fault=None):
    import jtrain
    from jtrain.control import faults

    with pytest.MonkeyPatch.context() as mp:
        if devices:  # a mesh of the first devices only
            mp.setattr(mesh_lib, "make_mesh",
                       functools.partial(mesh_lib.make_mesh, devices=jax.devices()[:devices]))
        if fault:
            mp.setenv(faults.FAULT_ENV, fault)
        return jtrain.train(cfg, str(workdir), model=model, train_data=DATA,
                            eval_data=DATA[:16])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    assert jax.device_count() == 8
    base = tmp_path_factory.mktemp("auto_shard")
    out = {k: base / k for k in ("straight", "resumed", "elastic", "elastic1", "one",
                                 "linen")}
    out["state"] = _train(out["straight"], _nnx_config(fsdp=8), _mlp()).state
    out["stopped"] = _train(out["resumed"], _nnx_config(fsdp=8), _mlp(),
                            fault="step:2:TERM").summary
    shutil.copytree(out["resumed"], out["elastic"])
    shutil.copytree(out["resumed"], out["elastic1"])
    out["resumed_summary"] = _train(out["resumed"], _nnx_config(fsdp=8), _mlp()).summary
    elastic = _train(out["elastic"], _nnx_config(data=2, fsdp=4), _mlp())
    out["elastic_state"], out["elastic_summary"] = elastic.state, elastic.summary
    out["one_state"] = _train(out["one"], _nnx_config(fsdp=1), _mlp(), devices=1).state
    elastic1 = _train(out["elastic1"], _nnx_config(fsdp=1), _mlp(), devices=1)
    out["elastic1_state"], out["elastic1_summary"] = elastic1.state, elastic1.summary
    net = _net()
    linen = _train(out["linen"], LINEN_CONFIG, net)
    out["net"], out["linen_state"], out["linen_history"] = net, linen.state, linen.train_history
    return out


def _header_numbers(log):
    m = re.search(r"jtrain: sharding: params ([\d,]+) of ([\d,]+) bytes per device "
                  r"\((\d+) leaves sharded, (\d+) replicated(?:, (\d+) replicated "
                  r"\(annotated\))?(?:, (\d+) too small)?.*optimizer state ([\d,]+) of", log)
    assert m, log
    return [int(g.replace(",", "")) if g else 0 for g in m.groups()]


def _per_device(tree):
    leaves = [a for a in jax.tree.leaves(tree) if hasattr(a, "addressable_shards")]
    return sum(a.addressable_shards[0].data.nbytes for a in leaves)


def _read(workdir, name):
    return open(os.path.join(workdir, name)).read()


def _specs(tree):
    return {jax.tree_util.keystr(p): a.sharding.spec
            for p, a in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.multidevice
def test_an_unannotated_model_is_sharded_over_fsdp(runs):
    state, log = runs["state"], _read(runs["straight"], "train.log")
    # threshold 0: every leaf with a dimension divisible by 8 is sharded (the [4] bias is
    # not): ~1/8 of the bytes per device, as the header and run.json say
    per, total, sharded, repl, annotated, small, opt = _header_numbers(log)
    params = jax.tree.leaves(state.params)
    assert (per, total) == (_per_device(params), sum(a.nbytes for a in params))
    assert opt == _per_device(state.opt_state)
    assert (sharded, repl, annotated, small) == (3, 1, 0, 0)
    assert per == (32 * 64 + 64 + 64 * 4) * 4 // 8 + 4 * 4
    decided = json.loads(_read(runs["straight"], "run.json"))["decided"]
    assert decided["mesh.auto_shard"]["params"]["per_device_bytes"] == per
    assert _specs(state.params)["['hidden']['kernel']"] == P(None, "fsdp")
    assert "shards no parameter" not in log
    # the weight EMA is sharded exactly like its params
    assert _specs(state.ema) == _specs(state.params)


@pytest.mark.multidevice
def test_fsdp8_equals_a_one_device_run(runs):
    assert runs["one_state"].params["hidden"]["kernel"].sharding.mesh.size == 1
    eight, one = metric_by_step(runs["straight"]), metric_by_step(runs["one"])
    assert sorted(eight) == sorted(one) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([eight[s] for s in one], [one[s] for s in one],
                               rtol=1e-5, atol=1e-6)
    for name in ("params", "ema"):  # the end states too, leaf by leaf
        jax.tree.map(lambda a, b: np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6),
            getattr(runs["state"], name), getattr(runs["one_state"], name))


@pytest.mark.multidevice
def test_kill_and_resume_on_the_same_mesh_is_bitwise(runs):
    assert runs["stopped"]["stopped_by"] == "SIGTERM"
    assert runs["resumed_summary"]["resumed_from"] == runs["stopped"]["step"] == 2
    straight = _read(runs["straight"], "hashes.jsonl")
    assert len(straight.splitlines()) == STEPS
    assert _read(runs["resumed"], "hashes.jsonl") == straight


@pytest.mark.multidevice
@pytest.mark.parametrize("name,mesh_shape,kernel_shard", [
    ("elastic", {"data": 2, "fsdp": 4, "expert": 1, "context": 1, "tensor": 1, "stage": 1},
     (32, 16)),
    ("elastic1", {"data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1, "stage": 1},
     (32, 64))])
def test_an_auto_sharded_checkpoint_resumes_under_another_mesh(runs, name, mesh_shape,
                                                              kernel_shard):
    """fsdp=8 -> data=2 x fsdp=4, and -> one device: the params reshard (auto_shard's
    rule for the new mesh) and the run goes on to the straight run's losses and state."""
    assert runs[f"{name}_summary"]["resumed_from"] == 2
    state = runs[f"{name}_state"]
    kernel = state.params["hidden"]["kernel"]
    assert dict(kernel.sharding.mesh.shape) == mesh_shape
    assert kernel.addressable_shards[0].data.shape == kernel_shard
    assert _specs(state.ema) == _specs(state.params)
    elastic, straight = metric_by_step(runs[name]), metric_by_step(runs["straight"])
    np.testing.assert_allclose([elastic[s] for s in (3, 4)], [straight[s] for s in (3, 4)],
                               rtol=1e-5, atol=1e-6)
    for field in ("params", "ema"):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6), getattr(state, field),
            getattr(runs["state"], field))


def _moment_specs(opt_state):
    """{param path: spec} of Adam's first moments (arrays or their shardings)."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        name = jax.tree_util.keystr(path)
        if ".mu" in name:
            out[name.split(".mu", 1)[1]] = getattr(leaf, "sharding", leaf).spec
    return out


@pytest.mark.multidevice
def test_frozen_leaves_and_the_ema_keep_the_layout(runs):
    """Default threshold (4 KiB) on data=2 x fsdp=4: the [32, 256] kernel is sharded,
    also while optim.frozen holds it (no optimizer state); the annotated kernel keeps
    its annotation; the EMA and Adam's moments follow the params."""
    state, log = runs["linen_state"], _read(runs["linen"], "train.log")
    specs = _specs(state.params)
    assert specs["['Dense_0']['kernel']"] == P(None, "fsdp")
    assert specs["['kept']['kernel']"] == P(None, None)
    per, total, sharded, repl, annotated, small, opt = _header_numbers(log)
    assert (sharded, repl, annotated, small) == (1, 0, 1, 4)
    assert (per, opt) == (_per_device(state.params), _per_device(state.opt_state))
    assert _specs(state.ema) == specs
    moments = _moment_specs(state.opt_state)
    assert sorted(moments) == sorted(k for k in specs if "Dense_0" not in k)
    assert all(v == specs[k] for k, v in moments.items())


@pytest.mark.multidevice
def test_lora_adapters_follow_the_layout():
    """finetune.lora on data=2 x fsdp=4 (the set-up only: jtrain.build's abstract state):
    the [4, 256] adapter B is sharded like its kernel; qwix gives the annotated kernel's
    adapters its annotation (counted "replicated (annotated)", not "too small"); the
    frozen base holds no optimizer state; the EMA and the moments follow the params."""
    import jtrain

    cfg = jtrain.resolve({**LINEN_CONFIG, "optim": {"ema": {"decay": 0.9}},
                          "finetune": {"lora": {"rank": 4, "targets": "Dense|kept"}}})
    b = jtrain.build(cfg, sample=X[0], eval_example=DATA[0], model=_net())
    specs = jax.tree_util.tree_flatten_with_path(b.shardings.params)[0]
    specs = {jax.tree_util.keystr(p): s.spec for p, s in specs}
    assert specs["['Dense_0']['kernel']"] == specs["['Dense_0']['kernel_lora_b']"] \
        == P(None, "fsdp")
    assert specs["['kept']['kernel_lora_a']"] == P(None, None)  # 4 KiB, annotated
    assert specs["['kept']['kernel_lora_b']"] == P(None, None)
    line = header.sharding_lines(cfg.mesh, b.mesh, b.abstract, b.shardings)[0]
    assert "(2 leaves sharded, 0 replicated, 3 replicated (annotated), 7 too small" in line
    assert jax.tree.map(lambda s: s.spec, b.shardings.ema) == \
        jax.tree.map(lambda s: s.spec, b.shardings.params)
    moments = _moment_specs(b.shardings.opt_state)
    assert sorted(moments) == sorted(k for k in specs if "_lora_" in k)
    assert all(v == specs[k] for k, v in moments.items())


@pytest.mark.multidevice
def test_train_accuracy_on_8_devices_with_microbatches_is_exact(runs):
    """data=2 x fsdp=4, grad_accum_steps=2: the log step's batch, counted over
    microbatches and devices, equals numpy's recomputation."""
    params = jax.tree.map(np.asarray, runs["linen_state"].params)
    logits = np.asarray(runs["net"].apply({"params": params}, X))
    history = runs["linen_history"]
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        top1, top2 = accuracies(logits, Y, slice((h["step"] - 1) * 16, h["step"] * 16))
        assert h["train/accuracy"] == pytest.approx(top1, abs=1e-12)
        assert h["train/top_2_accuracy"] == pytest.approx(top2, abs=1e-12)


def test_an_expert_axis_without_experts_says_it_splits_the_batch():
    mesh = AbstractMesh((1, 1, 8, 1, 1, 1), mesh_lib.MESH_AXES)
    lines = header.sharding_lines({"auto_shard": True}, mesh,
                                  types.SimpleNamespace(params=_tree(w=(16, 64)), opt_state={}),
                                  types.SimpleNamespace(params={"w": NamedSharding(mesh, P())},
                                                        opt_state={}))
    assert lines[1:] == ["jtrain: warning: mesh.expert=8 shards no parameter: its devices "
                         "hold copies; only weights with the logical axis 'expert' "
                         "(model.moe's experts) split over it; the batch is split over it "
                         "as over mesh.data"]
