"""model.dtype applies to your own model without its cooperation: a Linen or NNX model
built without a dtype computes in bfloat16 / float16 (params stay float32 in the state,
norm scales stay float32, outputs come back float32), and float16 trains with the
dynamic loss scale."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jtrain

SEEN = []


class Linen(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        SEEN.append(("input", x.dtype))
        h = nn.Dense(16)(x)
        SEEN.append(("dense", h.dtype))
        h = nn.LayerNorm()(h)
        return nn.Dense(2)(nn.relu(h))


class Nnx(nnx.Module):
    def __init__(self, rngs):
        self.body = nnx.Linear(4, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.head = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        SEEN.append(("input", x.dtype))
        SEEN.append(("norm scale", self.norm.scale[...].dtype))
        h = self.body(x)
        SEEN.append(("dense", h.dtype))
        return self.head(nnx.relu(self.norm(h)))


def _data():
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    return {"inputs": x, "targets": (x[:, 0] > 0).astype(np.int32)}


@pytest.mark.slow  # seconds of CPU: the full suite runs it (tests/README.md)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("make", [Linen, lambda: Nnx(nnx.Rngs(0))], ids=["linen", "nnx"])
def test_user_model_computes_in_the_policy_dtype(tmp_path, make, dtype):
    SEEN.clear()
    cfg = {"total_steps": 4, "data": {"batch_size": 8}, "eval": {"every_steps": 4},
           "log": {"verbosity": 0}, "model": {"dtype": dtype},
           "optim": {"lr": 0.01, "schedule": "constant"}}
    res = jtrain.train(cfg, str(tmp_path / "run"), model=make(), train_data=_data())
    seen = dict(SEEN)
    assert seen["input"] == jnp.dtype(dtype) and seen["dense"] == jnp.dtype(dtype), SEEN
    if "norm scale" in seen:
        assert seen["norm scale"] == jnp.float32  # model.keep_fp32 = ("norm",)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(res.state.params))
    assert np.isfinite(res.summary["eval/loss"])
    if dtype == "float16":  # the dynamic loss scale runs on a float16 model now
        assert float(res.state.loss_scale["scale"]) > 1.0
