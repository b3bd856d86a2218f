"""model.remat: per-block rematerialisation of the built-in transformer gives the same
parameters, loss and gradients as no remat, for every policy (what XLA:CPU's compiled
step keeps in temp memory is printed, not asserted: this process runs XLA:CPU's default
concurrency-optimised scheduler, under which remat does not shrink it; the scheduler
jtrain's entry points set on CPU does, see docs/guide/user-models-precision.md)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jtrain
from jtrain import models
from jtrain.errors import ConfigError
from jtrain.models import transformer

MODEL = {"d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64, "max_len": 16,
         "dropout": 0.1}


def _loss_and_grads(remat):
    module = models.make_model({**MODEL, "name": "transformer", "remat": remat},
                               dtype=jnp.float32, param_dtype=jnp.float32)
    assert module.remat == remat
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 16)), jnp.int32)
    params = module.init(jax.random.key(0), tokens)["params"]

    def loss(p):  # dropout on: the recomputed forward must draw the same masks
        logits = module.apply({"params": p}, tokens, train=True,
                              rngs={"dropout": jax.random.key(1)})
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits),
                                             tokens[..., None], -1))

    step = jax.jit(jax.value_and_grad(loss)).lower(params).compile()  # compiled once
    temp = step.memory_analysis().temp_size_in_bytes
    print(f"model.remat={remat}: compiled temp memory {temp:,} bytes")
    return params, *step(params)


@pytest.fixture(scope="module")
def without_remat():
    return _loss_and_grads("none")


@pytest.mark.slow  # seconds of CPU: the full suite runs it (tests/README.md)
@pytest.mark.parametrize("remat", ["full", "dots_saveable", "dots_with_no_batch_dims_saveable"])
def test_remat_gives_the_same_loss_and_gradients(remat, without_remat):
    params0, loss0, grads0 = without_remat
    params, loss, grads = _loss_and_grads(remat)
    assert jax.tree.structure(params) == jax.tree.structure(params0)  # same names
    np.testing.assert_allclose(loss, loss0, rtol=1e-6)
    for g, g0 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads0), strict=True):
        np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-7)


def test_remat_is_a_checked_key():
    assert jtrain.config.resolve({"model": {"remat": "full"}}).model.remat == "full"
    with pytest.raises(ConfigError) as e:
        jtrain.config.resolve({"model": {"remat": "everything"}})
    assert e.value.key == "model.remat"
    from jtrain.config import schema
    assert set(transformer.REMAT_POLICIES) == set(
        schema.MODEL_FAMILIES["transformer"]["remat"].check)
