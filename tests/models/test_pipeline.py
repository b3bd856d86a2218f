"""Pipeline stages (mesh.stage, mesh.microbatches): the GPipe schedule and its bubble;
the pipelined transformer's loss and gradients equal the plain model's (its params
stacked by `stack_layers`) on one device and on 8 (2 stages x 2 data x 2 fsdp, and 4
stages x 2 data), a few optimizer steps included; the dry run's parameters per device
divided by the stage count; what it refuses, in one line. The CLI under --verify_resume:
tests/journeys/test_pipeline_journey.py."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import jtrain
from jtrain import errors
from jtrain import mesh as mesh_lib
from jtrain.models import transformer

MODEL = dict(vocab_size=64, d_model=16, num_layers=4, num_heads=2, d_ff=32, max_len=16,
             dropout=0.0, tie_embeddings=False)


def test_the_schedule_is_gpipe_and_its_bubble_is_counted_from_it():
    assert mesh_lib.gpipe(3, 2) == [(0, -1), (1, 0), (2, 1), (-1, 2)]
    for m, s in ((1, 2), (4, 2), (8, 4), (3, 3)):
        rows = mesh_lib.gpipe(m, s)
        assert len(rows) == m + s - 1
        for k in range(s):  # each stage runs every microbatch once, in order
            assert [r[k] for r in rows if r[k] >= 0] == list(range(m))
        assert mesh_lib.bubble(m, s) == pytest.approx((s - 1) / (m + s - 1))
    assert mesh_lib.bubble(4, 1) == 0.0


def _tokens(rows=8):
    return jnp.asarray(np.random.default_rng(0).integers(0, 64, (rows, 9)), jnp.int32)


def _loss(module, params, tokens):
    logits = module.apply({"params": params}, tokens[:, :-1])
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)
    return jnp.mean(nll)


def _trained(module, params, tokens, steps=2):
    """(loss, gradients) at params, and params after `steps` Adam steps."""
    tx = optax.adam(1e-2)
    grad = jax.value_and_grad(lambda p: _loss(module, p, tokens))
    first = grad(params)
    opt = tx.init(params)
    for _ in range(steps):
        g = grad(params)[1]
        updates, opt = tx.update(g, opt, params)
        params = optax.apply_updates(params, updates)
    return first, params


def _plain_and_stacked(stages):
    plain = transformer.Transformer(**MODEL)
    params = nn.unbox(plain.init(jax.random.key(0), _tokens()[:, :-1])["params"])
    return plain, params, transformer.stack_layers(params, stages)


def _assert_close(pipelined, plain, stages):
    (loss, grads), params = pipelined
    (loss0, grads0), params0 = plain
    np.testing.assert_allclose(loss, loss0, rtol=1e-6)
    for want, got in ((grads0, grads), (params0, params)):
        want = transformer.stack_layers(want, stages)
        assert jax.tree.structure(want) == jax.tree.structure(got)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # compiles both models' gradients and steps: about 8 CPU s
def test_one_device_pipeline_is_the_plain_model_packed_rows_included():
    stages = 4  # two stages: the 8-device tests
    plain, params, stacked = _plain_and_stacked(stages)
    pipe = transformer.Transformer(**MODEL, stages=stages, microbatches=4)
    boxed = pipe.init(jax.random.key(0), _tokens()[:, :-1])["params"]
    assert jax.tree.structure(nn.unbox(boxed)) == jax.tree.structure(stacked)
    assert boxed["pipeline"]["layer_0"]["mlp"]["wi"].names == ("stage", "embed", "mlp")
    tokens = _tokens()
    _assert_close(jax.jit(_trained, static_argnums=0)(pipe, stacked, tokens),
                  jax.jit(_trained, static_argnums=0)(plain, params, tokens), stages)
    # packed rows: each microbatch's segment ids and positions reach its stages
    col, start = np.arange(8)[None, :], 1 + np.arange(8)[:, None] % 6  # row r: 2 documents
    packed = {"inputs": tokens[:, :-1], "segment_ids": jnp.asarray(col >= start, jnp.int32),
              "positions": jnp.asarray(np.where(col < start, col, col - start), jnp.int32)}
    np.testing.assert_allclose(pipe.apply({"params": stacked}, packed),
                               plain.apply({"params": params}, packed), rtol=1e-5, atol=1e-5)


@pytest.mark.multidevice
@pytest.mark.parametrize("stages,mesh", [(2, {"stage": 2, "data": 2, "fsdp": 2}),
                                         (4, {"stage": 4, "data": 2})])
def test_eight_devices_give_the_plain_models_loss_gradients_and_steps(stages, mesh):
    assert jax.device_count() == 8
    plain, params, stacked = _plain_and_stacked(stages)
    tokens = _tokens()
    one = jax.jit(_trained, static_argnums=0)(plain, params, tokens)
    pipe = transformer.Transformer(**MODEL, stages=stages, microbatches=2)
    mesh = mesh_lib.make_mesh(mesh)
    with mesh_lib.model_context(mesh):
        boxed = jax.eval_shape(pipe.init, jax.random.key(0), tokens[:, :-1])["params"]
        shardings = mesh_lib.logical_to_shardings(boxed, mesh)
        assert shardings["pipeline"]["layer_0"]["mlp"]["wi"].spec[0] == "stage"
        run = jax.jit(_trained, static_argnums=0, in_shardings=(
            shardings, mesh_lib.batch_sharding(mesh)), out_shardings=(None, shardings))
        got = run(pipe, jax.device_put(stacked, shardings),
                  jax.device_put(tokens, mesh_lib.batch_sharding(mesh)))
    _assert_close(got, one, stages)
    layers = mesh_lib.layout(nn.unbox(boxed)["pipeline"], shardings["pipeline"])
    if "fsdp" not in mesh.shape or mesh.shape["fsdp"] == 1:
        assert layers["per_device_bytes"] * stages == layers["total_bytes"]


def _config(mesh, **over):
    return {"seed": 0, "total_steps": 2, "model": {"name": "transformer", "d_model": 32,
            "num_layers": 4, "num_heads": 2, "d_ff": 64, "max_len": 16},
            "data": {"seq_len": 16, "batch_size": 16}, "mesh": mesh,
            "eval": {"every_steps": 0, "num_batches": 1}, **over}


@pytest.mark.multidevice
def test_the_dry_run_holds_the_layers_once_per_stage():
    """State per device (params and both Adam moments, float32): with 2 stages the
    blocks' share is halved, the embedding, final norm and logits are not."""
    from jtrain.engine import dry_run

    say = lambda *_: None  # noqa: E731
    plain = dry_run.run(_config({"data": 8}), say=say)["state_bytes_per_device"]
    staged = dry_run.run(_config({"stage": 2, "data": 4, "microbatches": 2}),
                         say=say)["state_bytes_per_device"]
    d, f, layers = 32, 64, 4
    block = 4 * d * d + 2 * d * f + 2 * d  # q, k, v, out; mlp in, out; two norms
    assert plain - staged == 3 * 4 * layers * block // 2


@pytest.mark.parametrize("over,key", [
    ({"model": {"name": "mlp"}}, "mesh.stage"),
    ({"model": {"name": "transformer", "num_layers": 3}}, "mesh.stage"),
    ({"model": {"name": "transformer", "moe": {"experts": 2}}}, "model.moe.experts"),
    ({"model": {"name": "transformer", "quant": "int8"}}, "model.quant"),
    ({"finetune": {"lora": {"rank": 2}}}, "finetune.lora.rank"),
    ({"population": {"size": 2}}, "population.size"),
    ({"determinism": {"topology_invariant": True}}, "determinism.topology_invariant"),
])
def test_what_pipeline_stages_refuse_is_one_line(over, key):
    cfg = {**_config({"stage": 2, "data": 1}), **over}
    if over.get("model", {}).get("name") == "transformer":
        cfg["model"] = {**_config({})["model"], **over["model"]}
    with pytest.raises(errors.ConfigError) as e:
        jtrain.config.resolve(cfg)
    assert e.value.key == key
    assert "\n" not in errors.render(e.value)


def test_the_batch_must_split_into_microbatches_and_a_model_of_yours_is_refused():
    cfg = _config({"stage": 2, "data": 1, "microbatches": 3})
    with pytest.raises(errors.ConfigError) as e:
        jtrain.config.validate(jtrain.config.resolve(cfg), num_devices=2)
    assert e.value.key == "data.batch_size" and "mesh.microbatches=3" in str(e.value)
    from jtrain.engine import parts

    resolved = jtrain.config.resolve(_config({"stage": 2, "data": 1}))
    with pytest.raises(errors.ConfigError) as e:
        parts.model_object(resolved, transformer.Transformer(**MODEL), None)
    assert e.value.key == "mesh.stage" and "model of your own" in str(e.value)
