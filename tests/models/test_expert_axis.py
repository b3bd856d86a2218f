"""mesh.expert: a mixture of experts' experts split over their own mesh axis, tokens
sent to them by all-to-all (shard_map). On 8 fake devices the layer equals the one-device
dispatch of the same token groups (each batch shard routes its own tokens, drops
included) and, where nothing is dropped, the model's loss and gradients are one
device's, with expert 2, 4 and data 2 x expert 2 x fsdp 2; the compiled step holds
all-to-alls."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import jtrain
from jtrain import errors, models
from jtrain import mesh as mesh_lib
from jtrain.models import moe, transformer

from test_moe import MODEL, _loss_and_grads

MESHES = [{"expert": 2, "data": 4}, {"expert": 4, "data": 2},
          {"data": 2, "expert": 2, "fsdp": 2}]


def _grouped_reference(params, x, groups, k, factor, kind="gelu"):
    """One device: the tokens cut into `groups` equal runs in batch order, each routed
    with its own capacity (run_experts), f_e and P_e averaged, drops summed."""
    tokens = x.reshape(groups, -1, x.shape[-1])
    logits = jnp.einsum("gnd,de->gne", tokens, params["router"])
    weights = (params["wi"], params.get("wi_gate"), params["wo"])
    y, (routed, probs), dropped = jax.vmap(
        lambda t, lg: moe.run_experts(t, lg, weights, k, factor, kind, jnp.float32))(
            tokens, logits)
    return y.reshape(x.shape), moe.balance_loss((routed.mean(0), probs.mean(0))), dropped.sum()


@pytest.mark.multidevice
@pytest.mark.parametrize("axes", MESHES)
def test_the_layer_is_the_grouped_one_device_dispatch_drops_included(axes):
    block = transformer.MoeBlock(4, 2, 1.0, 64, jnp.float32, jnp.float32, "swiglu")
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 12, 32)), jnp.float32)
    params = nn.unbox(block.init(jax.random.key(1), x)["params"])
    mesh = mesh_lib.make_mesh(axes)
    groups = mesh_lib.data_parallel_size(mesh)
    want, aux, dropped = _grouped_reference(params, x, groups, 2, 1.0, "swiglu")
    assert float(dropped) > 0  # capacity 1.0 drops: the groups' own capacities matter
    with mesh_lib.model_context(mesh):
        y, sown = jax.jit(lambda p, x: block.apply({"params": p}, x,
                                                  mutable=["intermediates"]))(
            params, jax.device_put(x, mesh_lib.batch_sharding(mesh)))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sown["intermediates"]["moe_aux"][0], aux, rtol=1e-6)
    assert float(sown["intermediates"]["moe_dropped"][0]) == float(dropped)


@pytest.mark.multidevice
@pytest.mark.parametrize("axes", MESHES)
def test_the_loss_and_gradients_are_one_devices_and_the_step_has_all_to_alls(axes):
    """capacity_factor = experts / k: nothing dropped, so grouping changes nothing."""
    module = models.make_model({**MODEL, "moe": {"experts": 4, "k": 2,
                                                 "capacity_factor": 2.0}},
                               dtype=jnp.float32, param_dtype=jnp.float32)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (8, 17)), jnp.int32)
    boxed = module.init(jax.random.key(0), tokens[:, :-1])["params"]
    params = nn.unbox(boxed)
    one = jax.jit(_loss_and_grads, static_argnums=0)(module, params, tokens)
    mesh = mesh_lib.make_mesh(axes)
    shardings = mesh_lib.logical_to_shardings(boxed, mesh)
    wi = shardings["layer_0"]["moe"]["wi"]
    assert wi.shard_shape((4, 32, 64))[0] == 4 // (axes["expert"] * axes.get("fsdp", 1))
    step = jax.jit(_loss_and_grads, static_argnums=0,
                   in_shardings=(shardings, mesh_lib.batch_sharding(mesh)))
    args = (module, jax.device_put(params, shardings),
            jax.device_put(tokens, mesh_lib.batch_sharding(mesh)))
    with mesh_lib.model_context(mesh):
        hlo = step.lower(*args).compile().as_text()
        sharded = step(*args)
    assert hlo.count("all-to-all(") >= 8  # 2 layers x (2 forward + 2 backward)
    np.testing.assert_allclose(sharded[0], one[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(sharded[1]), jax.tree.leaves(one[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_an_expert_axis_that_does_not_divide_the_experts_is_refused():
    cfg = {"model": {**MODEL, "moe": {"experts": 4}}, "mesh": {"expert": 3, "data": 1},
           "data": {"name": "text", "seq_len": 16, "batch_size": 6}}
    with pytest.raises(errors.ConfigError) as e:
        jtrain.config.validate(jtrain.config.resolve(cfg), num_devices=3)
    assert errors.render(e.value) == ("jtrain: config error: mesh.expert: 3 does not divide "
                                      "model.moe.experts=4: each device of the expert axis "
                                      "holds an equal share")
