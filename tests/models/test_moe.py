"""model.moe: the built-in transformer's top-k routed MLP. The layer equals a plain
loop over tokens (each token's top-k experts weighted by renormalised gates, capacity
drops applied in priority order) and counts its drops exactly; experts=0 is the dense
model; the FLOPs count k active experts; a short run's loss decreases and resumes
bitwise; a mixture-of-experts run samples and refuses the Hugging Face export; on 8 fake
devices (experts split over fsdp) the loss and gradients are one device's. MODEL and
MOE are the example of docs/guide/scaling-out.md."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import jtrain
from jtrain import errors, models
from jtrain import mesh as mesh_lib
from jtrain import state as state_lib
from jtrain.models import moe, transformer

MODEL = {"name": "transformer", "d_model": 32, "num_layers": 2, "num_heads": 2,
         "d_ff": 64, "max_len": 16}
MOE = {"experts": 4, "k": 2, "capacity_factor": 1.0}


def _layer(kind="gelu", **moe_over):
    cfg = {**MOE, **moe_over}
    block = transformer.MoeBlock(cfg["experts"], cfg["k"], cfg["capacity_factor"], 64,
                                 jnp.float32, jnp.float32, kind)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 12, 32)), jnp.float32)
    params = block.init(jax.random.key(1), x)["params"]
    y, sown = block.apply({"params": params}, x, mutable=["intermediates"])
    params = jax.tree.map(np.asarray, nn.unbox(params))
    return cfg, params, np.asarray(x), np.asarray(y), sown["intermediates"]


def _gelu(h):  # the tanh approximation, as flax's nn.gelu
    return 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))


def reference(cfg, p, x, kind):
    """The layer written plainly: token by token, choice by choice, in float64."""
    tokens = x.reshape(-1, x.shape[-1]).astype(np.float64)
    n, e, k = len(tokens), cfg["experts"], cfg["k"]
    cap = math.ceil(cfg["capacity_factor"] * n * k / e)
    logits = tokens @ p["router"]
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    order = np.argsort(-probs, axis=1, kind="stable")[:, :k]  # ties: lower index first
    used, kept = np.zeros(e, int), np.zeros((n, k), bool)
    for j in range(k):  # every token's first choice, then every token's second
        for t in range(n):
            if used[order[t, j]] < cap:
                used[order[t, j]] += 1
                kept[t, j] = True
    out = np.zeros_like(tokens)
    for t in range(n):
        gates = probs[t, order[t]] / probs[t, order[t]].sum()
        for j in range(k):
            if kept[t, j]:
                ex = order[t, j]
                h = tokens[t] @ p["wi"][ex]  # up
                if kind == "swiglu":  # silu(gate) * up
                    g = tokens[t] @ p["wi_gate"][ex]
                    h = g / (1 + np.exp(-g)) * h
                else:
                    h = _gelu(h)
                out[t] += gates[j] * (h @ p["wo"][ex])
    return out.reshape(x.shape), int((~kept).sum())


@pytest.mark.parametrize("kind,factor", [("gelu", 1.0), ("swiglu", 0.5), ("gelu", 8.0)])
def test_layer_equals_a_loop_over_tokens_with_its_drops_counted(kind, factor):
    cfg, params, x, y, sown = _layer(kind, capacity_factor=factor)
    want, dropped = reference(cfg, params, x, kind)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5)
    assert float(sown["moe_dropped"][0]) == dropped
    assert float(sown["moe_assigned"][0]) == 24 * cfg["k"]
    assert (dropped > 0) == (factor < 8.0)  # the small factors drop, the large one none


def test_ties_go_to_the_lower_index_and_drops_are_exact():
    # 8 tokens, all logits equal: every token picks experts 0 and 1; capacity
    # ceil(1 * 8 * 2 / 4) = 4, so tokens 0-3 are kept on both and 4-7 dropped on both.
    dispatch, combine, balance, dropped = moe.route(jnp.zeros((8, 4)), 2, 1.0)
    assert float(dropped) == 8
    kept = np.asarray(dispatch).sum(-1)  # [N, E]
    np.testing.assert_array_equal(kept[:4], [[1, 1, 0, 0]] * 4)
    np.testing.assert_array_equal(kept[4:], 0)
    np.testing.assert_allclose(np.asarray(combine).sum((1, 2))[:4], 1.0)
    # Switch's balance loss: E * sum(f_e * P_e) = 4 * (0.5 * 0.25 * 2) = 1.
    np.testing.assert_allclose(float(moe.balance_loss(balance)), 1.0)
    assert moe.capacity(8, 4, 2, 1.0) == 4 and moe.capacity(3, 64, 1, 0.1) == 1


def test_experts_zero_is_the_dense_model_and_flops_count_k_experts():
    dense = models.make_model(MODEL, dtype=jnp.float32, param_dtype=jnp.float32)
    zero = models.make_model({**MODEL, "moe": {"experts": 0, "k": 1}}, dtype=jnp.float32,
                             param_dtype=jnp.float32)
    assert zero == dense and dense.moe == ()
    cfg = jtrain.config.resolve_model({**MODEL, "moe": MOE})
    base = jtrain.config.resolve_model(MODEL)
    # per token: one extra active expert MLP (2*D*F) and the router (D*E) per layer.
    extra = 2 * (2 * 32 * 64 + 32 * 4) * 6 * 16
    assert (models.flops_per_example(cfg, (16,))
            == models.flops_per_example(base, (16,)) + extra)
    with pytest.raises(errors.ConfigError) as e:
        jtrain.config.resolve_model({**MODEL, "moe": {"experts": 2, "k": 3}})
    assert e.value.key == "model.moe.k"


STEPS = 8


def _config(total=STEPS, **over):
    return {"seed": 0, "total_steps": total, "model": {**MODEL, "moe": MOE},
            "data": {"seq_len": 16, "batch_size": 8},
            "optim": {"lr": 3e-3, "decay_steps": STEPS},
            "log": {"every_steps": 1}, "eval": {"every_steps": 0, "num_batches": 1},
            "checkpoint": {"every_steps": 4}, **over}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("moe")
    straight = jtrain.train(_config(sample={"prompts": ["def "], "max_new_tokens": 4}),
                            str(base / "straight"))  # ends with a sample
    jtrain.train(_config(total=4), str(base / "resumed"))
    resumed = jtrain.train(_config(), str(base / "resumed"))
    return straight, resumed, base


@pytest.mark.slow  # trains three short runs: the full suite runs it
def test_training_reports_the_terms_lowers_the_loss_and_resumes_bitwise(runs):
    straight, resumed, _ = runs
    losses = [h["train/loss"] for h in straight.train_history]
    assert losses[-1] < losses[0]
    last = straight.train_history[-1]
    assert 1.0 <= last["train/moe_aux_loss"] < 4.0  # E * sum f*P: 1 when balanced, <= E
    assert 0.0 <= last["train/moe_dropped_fraction"] < 1.0
    assert (state_lib.state_sha256(resumed.state)
            == state_lib.state_sha256(straight.state))


@pytest.mark.slow  # trains three short runs: the full suite runs it
def test_a_moe_run_samples_and_refuses_the_hf_export(runs):
    pytest.importorskip("transformers")
    _, _, base = runs
    out = jtrain.sample(str(base / "straight"), ["def "], max_new_tokens=4, seed=0)
    assert len(out) == 1 and len(out[0].tokens) == 4
    # the run's own end-of-run sample, from the final state: the same greedy text
    assert any(ln.endswith(f" jtrain: sample: 'def ' -> {out[0].text!r}") for ln in (
        base / "straight" / "train.log").read_text().splitlines())
    from jtrain.checkpoint import hf_export
    with pytest.raises(errors.ConfigError) as e:
        hf_export.export(str(base / "straight"), str(base / "hf"))
    assert e.value.key == "model.moe.experts"
    assert "not exportable to Hugging Face" in errors.render(e.value)
    assert not (base / "hf").exists()


def test_moe_with_lora_is_refused():
    with pytest.raises(errors.ConfigError) as e:
        jtrain.config.resolve(_config(finetune={"lora": {"rank": 2}}))
    assert e.value.key == "finetune.lora.rank"


def test_moe_with_8_bit_matmuls_is_refused():
    """The MoE training forward is the transformer's own, not qwix's quantised one: a
    header counting quantised matmuls would not be what ran."""
    with pytest.raises(errors.ConfigError) as e:
        jtrain.config.resolve(_config(model={**_config()["model"], "quant": "int8"}))
    assert e.value.key == "model.quant"
    assert "model.moe.experts" in errors.render(e.value)


def _loss_and_grads(module, params, tokens):
    def loss(p):
        logits, sown = module.apply({"params": p}, tokens[:, :-1],
                                    mutable=["intermediates"])
        totals = moe.sown_totals(sown["intermediates"])
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)
        return jnp.mean(nll) + 0.01 * totals["moe_aux"] / totals["layers"]
    return jax.value_and_grad(loss)(params)


@pytest.mark.multidevice
def test_eight_devices_give_one_devices_loss_and_gradients():
    """data=2 x fsdp=2 x tensor=2: experts split over fsdp, their MLP width over tensor."""
    assert jax.device_count() == 8
    module = models.make_model({**MODEL, "moe": MOE}, dtype=jnp.float32,
                               param_dtype=jnp.float32)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (8, 17)), jnp.int32)
    boxed = module.init(jax.random.key(0), tokens[:, :-1])["params"]
    params = nn.unbox(boxed)
    one = jax.jit(_loss_and_grads, static_argnums=0)(module, params, tokens)
    mesh = mesh_lib.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    shardings = mesh_lib.logical_to_shardings(boxed, mesh)
    wi = shardings["layer_0"]["moe"]["wi"].spec
    assert tuple(wi) == ("fsdp", None, "tensor")
    with mesh_lib.model_context(mesh):
        sharded = jax.jit(_loss_and_grads, static_argnums=0,
                          in_shardings=(shardings, mesh_lib.batch_sharding(mesh)))(
            module, jax.device_put(params, shardings),
            jax.device_put(tokens, mesh_lib.batch_sharding(mesh)))
    np.testing.assert_allclose(sharded[0], one[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(sharded[1]), jax.tree.leaves(one[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
