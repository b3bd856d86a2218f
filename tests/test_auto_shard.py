"""mesh.auto_shard: a parameter the model did not annotate is sharded over fsdp along
its largest divisible dimension (above mesh.auto_shard_min_bytes); annotated ones keep
their annotation; the header says the bytes per device, the run.json records them, and
an axis that shards nothing is a warning. On 8 fake devices: an unannotated NNX and
Linen model under fsdp=8 hold ~1/8 of their params per device (counted from the arrays'
addressable shards) and train to the same losses as with the params replicated."""

import json
import re
import types

import numpy as np
import pytest

from jtrain import mesh as mesh_lib

FAKE = types.SimpleNamespace(shape={"data": 1, "fsdp": 8, "tensor": 1})


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
    one = types.SimpleNamespace(shape={"data": 8, "fsdp": 1, "tensor": 1})
    assert mesh_lib.auto_dims((8, 128), np.float32, one, 0) == ()  # no fsdp axis
    assert mesh_lib.auto_shard_bytes({"auto_shard": False}) is None
    assert mesh_lib.auto_shard_bytes() == 4096


SCRIPT = '''
import json, jax, numpy as np, jtrain
from flax import linen as nn, nnx

class Mlp(nnx.Module):  # no annotations
    def __init__(self, rngs):
        self.hidden = nnx.Linear(32, 64, rngs=rngs)
        self.out = nnx.Linear(64, 4, rngs=rngs)
    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))

class Net(nn.Module):  # one kernel annotated replicated: it must stay so
    @nn.compact
    def __call__(self, x, train=False):
        h = nn.relu(nn.Dense(64)(x))
        h = nn.relu(nn.Dense(64, kernel_init=nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), (None, None)), name="kept")(h))
        return nn.Dense(4)(h)

x = np.random.default_rng(0).normal(size=(96, 32)).astype(np.float32)
y = (x[:, 0] > 0).astype(np.int32) + 2 * (x[:, 1] > 0)
data = [{"inputs": a, "targets": b} for a, b in zip(x, y)]

def run(name, model, **mesh):
    cfg = {"total_steps": 2, "data": {"batch_size": 16, "shuffle": False},
           "mesh": {"data": 1, "fsdp": 8, **mesh}, "eval": {"every_steps": 0},
           "log": {"every_steps": 1, "writers": ["jsonl"]}, "compile": {"cache_dir": ""}}
    r = jtrain.train(cfg, "runs/" + name, model=model, train_data=data, eval_data=data[:16])
    params = jax.tree.leaves(r.state.params)
    opt = [a for a in jax.tree.leaves(r.state.opt_state) if hasattr(a, "addressable_shards")]
    return {"losses": [h["train/loss"] for h in r.train_history],
            "per_device": sum(a.addressable_shards[0].data.nbytes for a in params),
            "total": sum(a.nbytes for a in params),
            "opt_per_device": sum(a.addressable_shards[0].data.nbytes for a in opt),
            "specs": {jax.tree_util.keystr(p): str(a.sharding.spec) for p, a in
                      jax.tree_util.tree_flatten_with_path(r.state.params)[0]},
            "log": open("runs/%s/train.log" % name).read(),
            "decided": json.load(open("runs/%s/run.json" % name))["decided"]}

out = {"nnx": run("nnx", Mlp, auto_shard_min_bytes=0),
       "nnx_off": run("nnx_off", Mlp, auto_shard=False),
       "linen": run("linen", Net())}
print("RESULT " + json.dumps(out))
'''


def _header_numbers(log):
    m = re.search(r"jtrain: sharding: params ([\d,]+) of ([\d,]+) bytes per device "
                  r"\((\d+) leaves sharded, (\d+) replicated(?:, (\d+) too small)?.*"
                  r"optimizer state ([\d,]+) of", log)
    assert m, log
    return [int(g.replace(",", "")) if g else 0 for g in m.groups()]


@pytest.mark.multidevice
def test_unannotated_models_shard_over_fsdp(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    exec(compile(SCRIPT, "auto_shard_script", "exec"), {"__name__": "auto_shard_script"})
    out = json.loads(capsys.readouterr().out.split("RESULT ", 1)[1])
    nnx, off, linen = out["nnx"], out["nnx_off"], out["linen"]
    # NNX, threshold 0: every leaf with a dimension divisible by 8 is sharded (the [4]
    # bias is not): ~1/8 of the bytes per device, as the header and run.json say.
    per, total, sharded, repl, small, opt = _header_numbers(nnx["log"])
    assert (per, total) == (nnx["per_device"], nnx["total"])
    assert opt == nnx["opt_per_device"]
    assert (sharded, repl, small) == (3, 1, 0)
    assert per == (32 * 64 + 64 + 64 * 4) * 4 // 8 + 4 * 4
    assert nnx["decided"]["mesh.auto_shard"]["params"]["per_device_bytes"] == per
    assert nnx["specs"]["['hidden']['kernel']"] == "P(None, 'fsdp')"
    # auto_shard off: replicated, and said so; the same losses either way
    per, total, sharded, *_ = _header_numbers(off["log"])
    assert per == total == off["per_device"] and sharded == 0
    assert "jtrain: warning: mesh.fsdp=8 shards no parameter" in off["log"]
    np.testing.assert_allclose(nnx["losses"], off["losses"], rtol=1e-5, atol=1e-6)
    assert "warning: mesh.fsdp" not in nnx["log"]
    # Linen, default threshold (4 KiB): the two 64-wide kernels are sharded except the
    # annotated one; biases and the [64, 4] kernel are too small.
    specs = {k.replace("['params']", ""): v for k, v in linen["specs"].items()}
    assert specs["['kept']['kernel']"] == "P(None, None)", specs
    assert specs["['Dense_0']['kernel']"] == "P(None, 'fsdp')"
    per, total, sharded, repl, small, _ = _header_numbers(linen["log"])
    assert (per, total) == (linen["per_device"], linen["total"])
    assert (sharded, repl, small) == (1, 1, 4)
