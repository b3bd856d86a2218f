"""Logical axis names under jtrain's mesh: an NNX model annotated with the names the
built-in models use (`nnx.with_partitioning(init, ("embed", "mlp"))`) builds and trains
without the user applying jtrain.mesh.LOGICAL_RULES, its kernel sharded as the rules
say; a name that is neither a rule nor a mesh axis is a one-line ConfigError naming the
parameter (NNX and Linen)."""

import flax.linen as nn
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jtrain
from jtrain.errors import ConfigError


class Annotated(nnx.Module):
    def __init__(self, rngs, names=("embed", "mlp")):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), names)
        self.hidden = nnx.Linear(16, 32, kernel_init=init, rngs=rngs)
        self.out = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))[..., 0]


class LinenTypo(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "hiddn"))
        return nn.Dense(1, kernel_init=init)(x)[..., 0]


def _data():
    x = np.random.default_rng(0).normal(size=(64, 16)).astype(np.float32)
    return {"inputs": x, "targets": x.sum(-1)}


def _cfg(**mesh):
    return {"total_steps": 2, "data": {"batch_size": 16}, "log": {"verbosity": 0},
            "eval": {"every_steps": 2}, "mesh": {"data": 1, **mesh}}


@pytest.mark.multidevice
@pytest.mark.parametrize("mesh, shard", [({"fsdp": 8}, (2, 32)), ({"fsdp": 4, "tensor": 2},
                                                                  (4, 16))],
                         ids=["fsdp8", "fsdp4-tensor2"])
def test_an_nnx_model_with_logical_names_trains_sharded_by_the_rules(tmp_path, mesh, shard):
    res = jtrain.train(_cfg(**mesh), str(tmp_path / "run"), model=Annotated,
                       train_data=_data())
    kernel = res.state.params["hidden"]["kernel"]
    # embed -> fsdp, mlp -> tensor (jtrain.mesh.LOGICAL_RULES)
    assert kernel.sharding.spec == P("fsdp", "tensor"), kernel.sharding
    assert kernel.addressable_shards[0].data.shape == shard
    assert np.isfinite(res.summary["eval/loss"])


@pytest.mark.parametrize("model", [lambda rngs: Annotated(rngs, ("embed", "hiddn")),
                                   LinenTypo()], ids=["nnx", "linen"])
def test_an_unknown_logical_name_is_a_config_error_naming_the_parameter(tmp_path, model):
    with pytest.raises(ConfigError) as e:
        jtrain.train(_cfg(), str(tmp_path / "run"), model=model, train_data=_data())
    assert e.value.key == "model"
    assert "kernel" in e.value.why and "'hiddn'" in e.value.why, e.value.why
    assert "\n" not in str(e.value)
