"""Tests for jtrain.optim: schedules, optimizers, clipping and the weight-decay mask."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from jtrain import config as config_lib
from jtrain import optim

V, D = 11, 4


def cfg(**overrides):
    return ml_collections.ConfigDict({**config_lib.defaults().optim.to_dict(), **overrides})


def sched_at(schedule, steps):
    return [float(schedule(s)) for s in steps]


def linen_params():
    """A hand-built Linen transformer-like tree (values distinct from zero)."""
    k = iter(jax.random.split(jax.random.key(0), 4))
    return {
        "params": {
            "embed": {"embedding": jax.random.normal(next(k), (V, D))},  # [V, D]
            "block_0": {
                "attn": {
                    "kernel": jax.random.normal(next(k), (D, D)),  # [D, D]
                    "bias": jax.random.normal(next(k), (D,)),  # [D]
                },
                "norm": {"scale": 1.0 + jax.random.normal(next(k), (D,))},  # [D]
            },
        }
    }


def expected_mask(decay_embeddings):
    return {
        "params": {
            "embed": {"embedding": decay_embeddings},
            "block_0": {"attn": {"kernel": True, "bias": False}, "norm": {"scale": False}},
        }
    }


# Schedules: values by hand.


def test_warmup_cosine_values():
    s = optim.make_schedule(
        cfg(lr=1.0, schedule="warmup_cosine", warmup_steps=10, end_lr_factor=0.1), 110)
    # warmup midpoint, warmup end, cosine midpoint (step 60: half of 100 decay steps),
    # end (step 110) and after the end (held).
    got = sched_at(s, [0, 5, 10, 60, 110, 500])
    want = [0.0, 0.5, 1.0, 0.1 + 0.9 * 0.5, 0.1, 0.1]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_warmup_cosine_explicit_decay_steps():
    # decay_steps counts from step 0, warmup included; total_steps is then irrelevant.
    s = optim.make_schedule(cfg(lr=2.0, warmup_steps=4, decay_steps=24), 1000)
    np.testing.assert_allclose(sched_at(s, [2, 4, 14, 24, 999]), [1.0, 2.0, 1.0, 0.0, 0.0],
                               atol=1e-6)


def test_warmup_linear_values():
    s = optim.make_schedule(
        cfg(lr=1.0, schedule="warmup_linear", warmup_steps=10, end_lr_factor=0.2), 50)
    # decay from 1.0 at step 10 to 0.2 at step 50: 0.6 at step 30.
    np.testing.assert_allclose(sched_at(s, [5, 10, 30, 50, 80]), [0.5, 1.0, 0.6, 0.2, 0.2],
                               rtol=1e-6)


def test_linear_and_cosine_without_warmup():
    lin = optim.make_schedule(cfg(lr=0.5, schedule="linear"), 100)
    np.testing.assert_allclose(sched_at(lin, [0, 25, 100]), [0.5, 0.375, 0.0], atol=1e-7)
    cos = optim.make_schedule(cfg(lr=0.5, schedule="cosine", end_lr_factor=0.5), 100)
    want = [0.5, 0.25 + 0.25 * 0.5 * (1 + math.cos(math.pi / 4)), 0.375, 0.25]
    np.testing.assert_allclose(sched_at(cos, [0, 25, 50, 100]), want, rtol=1e-6)


def test_constant_with_and_without_warmup():
    s = optim.make_schedule(cfg(lr=0.3, schedule="constant"), 100)
    np.testing.assert_allclose(sched_at(s, [0, 50, 10_000]), [0.3] * 3, rtol=1e-6)
    s = optim.make_schedule(cfg(lr=0.3, schedule="constant", warmup_steps=3), 100)
    np.testing.assert_allclose(sched_at(s, [0, 1, 3, 99]), [0.0, 0.1, 0.3, 0.3], rtol=1e-6)


def test_cosine_with_warmup_equals_warmup_cosine():
    a = optim.make_schedule(cfg(schedule="cosine", warmup_steps=7, end_lr_factor=0.1), 40)
    b = optim.make_schedule(cfg(schedule="warmup_cosine", warmup_steps=7, end_lr_factor=0.1), 40)
    steps = list(range(0, 45, 3))
    np.testing.assert_allclose(sched_at(a, steps), sched_at(b, steps), rtol=1e-6)


def test_rsqrt_values():
    s = optim.make_schedule(cfg(lr=1.0, schedule="rsqrt", warmup_steps=10), 100)
    # warmup, then lr * sqrt(10 / step): 1 at warmup end, 1/2 at 4 * warmup.
    np.testing.assert_allclose(sched_at(s, [0, 5, 10, 40, 90]), [0.0, 0.5, 1.0, 0.5, 1 / 3],
                               rtol=1e-6)
    s = optim.make_schedule(cfg(lr=1.0, schedule="rsqrt"), 100)  # no warmup: sqrt(1 / max(step, 1))
    np.testing.assert_allclose(sched_at(s, [0, 1, 4, 16]), [1.0, 1.0, 0.5, 0.25], rtol=1e-6)


def test_schedule_works_under_jit_with_int32_steps():
    s = optim.make_schedule(cfg(lr=1.0, warmup_steps=10, end_lr_factor=0.1), 110)
    np.testing.assert_allclose(jax.jit(s)(jnp.int32(60)), 0.55, rtol=1e-6)


def test_decay_must_end_after_warmup():
    with pytest.raises(ValueError, match=r"optim\.decay_steps"):
        optim.make_schedule(cfg(warmup_steps=100), 100)


# Optimizers.


@pytest.mark.parametrize("name", optim.OPTIMIZERS)
def test_each_optimizer_decreases_a_quadratic(name):
    tx, _ = optim.make_optimizer(
        cfg(name=name, lr=1.0 if name == "prodigy" else 0.05, schedule="constant",
            weight_decay=0.0 if name == "adam" else 1e-4), 50
    )
    target = jnp.linspace(0.0, 2.0, 3 * 130).reshape(3, 130)  # [3, 130]: factored in adafactor
    # Start away from zero: adafactor scales its steps by the parameters' RMS.
    params = {"w": jnp.ones((3, 130)), "b": jnp.ones((130,))}

    def loss(p):
        return jnp.sum((p["w"] - target) ** 2) + jnp.sum((p["b"] - 2.0) ** 2)

    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    first = float(loss(params))
    for _ in range(50):
        params, opt_state = step(params, opt_state)
    assert float(loss(params)) < 0.05 * first, name


def test_unknown_names_raise():
    with pytest.raises(ValueError, match=r"^optim\.name: must be one of adamw, adam, .*prodigy "
                                         r"or optax\.<name>; got 'adamx' \(did you mean"):
        optim.make_optimizer(cfg(name="adamx"), 10)
    with pytest.raises(ValueError, match=r"^optim\.schedule: must be one of constant, .*; "
                                         r"got 'cosin' \(did you mean \"cosine\"\?\)"):
        optim.make_optimizer(cfg(schedule="cosin"), 10)
    with pytest.raises(ValueError, match=r"^optim\.schedule: unknown schedule"):
        optim.make_schedule(cfg(schedule="cosin"), 10)


def test_adam_with_weight_decay_raises():
    with pytest.raises(ValueError,
                       match=r"^optim\.weight_decay: adam has no weight decay.*use adamw"):
        optim.make_optimizer(cfg(name="adam", weight_decay=0.1), 10)


def test_clip_rescales_global_norm_to_clip_norm():
    tx, _ = optim.make_optimizer(
        cfg(name="sgd", lr=1.0, schedule="constant", kwargs={"momentum": 0.0}, clip_norm=1.0), 10)
    params = {"a": jnp.zeros((2, 3)), "b": jnp.zeros((3,))}
    grads = {"a": jnp.full((2, 3), 1e6), "b": jnp.arange(3.0) * 1e6}
    norm = math.sqrt(sum(float(jnp.sum(g**2)) for g in jax.tree.leaves(grads)))
    updates, _ = tx.update(grads, tx.init(params), params)
    for u, g in zip(jax.tree.leaves(updates), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(u, -g / norm, rtol=1e-6)
    assert float(optax.tree.norm(updates)) == pytest.approx(1.0, rel=1e-6)
    # A gradient already inside the ball passes untouched.
    small = jax.tree.map(lambda g: g * 1e-7, grads)
    updates, _ = tx.update(small, tx.init(params), params)
    for u, g in zip(jax.tree.leaves(updates), jax.tree.leaves(small), strict=True):
        np.testing.assert_allclose(u, -g, rtol=1e-6)


def test_sgd_momentum_and_nesterov_follow_config():
    params = {"w": jnp.zeros((2, 2))}
    g = {"w": jnp.ones((2, 2))}

    def two_updates(**kw):
        tx, _ = optim.make_optimizer(cfg(name="sgd", lr=1.0, schedule="constant", **kw), 10)
        state = tx.init(params)
        _, state = tx.update(g, state, params)
        u, _ = tx.update(g, state, params)
        return float(u["w"][0, 0])

    assert two_updates() == pytest.approx(-1.9)  # the default momentum 0.9: 1, then 0.9 + 1
    assert two_updates(kwargs={"momentum": 0.0}) == pytest.approx(-1.0)
    assert two_updates(kwargs={"momentum": 0.5}) == pytest.approx(-1.5)  # 1, then 0.5 + 1
    assert two_updates(kwargs={"momentum": 0.5, "nesterov": True}) == pytest.approx(-1.75)


def test_lion_uses_config_betas():
    params = {"w": jnp.zeros((3,))}
    tx, _ = optim.make_optimizer(cfg(name="lion", lr=0.1, schedule="constant", b1=0.0, b2=0.5), 10)
    state = tx.init(params)
    _, state = tx.update({"w": jnp.ones(3)}, state, params)
    # b1=0: the direction is sign(grad) of the current gradient alone, even against momentum.
    u, _ = tx.update({"w": -jnp.ones(3) * 1e-3}, state, params)
    np.testing.assert_allclose(u["w"], 0.1 * jnp.ones(3))


def test_returned_schedule_is_the_one_in_tx():
    # sgd without momentum and a unit gradient: update k has magnitude schedule(k).
    c = cfg(name="sgd", lr=0.7, kwargs={"momentum": 0.0}, warmup_steps=3, end_lr_factor=0.1)
    tx, schedule = optim.make_optimizer(c, 12)
    params = {"w": jnp.zeros((2, 2))}
    state = tx.init(params)
    for k in range(14):
        u, state = tx.update({"w": jnp.ones((2, 2))}, state, params)
        np.testing.assert_allclose(u["w"], -float(schedule(k)), rtol=1e-6, atol=1e-8)


def test_adamw_update_scales_with_schedule():
    # Adam normalises a constant gradient to a unit step (bias-corrected), so the
    # update at step k is lr(k) * (1 + wd * p) with p = 0: exactly schedule(k).
    c = cfg(name="adamw", lr=0.5, warmup_steps=4, end_lr_factor=0.0, eps=0.0)
    tx, schedule = optim.make_optimizer(c, 20)
    params = {"w": jnp.zeros((2, 3))}
    state = tx.init(params)
    for k in range(20):
        u, state = tx.update({"w": jnp.full((2, 3), 3.0)}, state, params)
        np.testing.assert_allclose(u["w"], -float(schedule(k)), rtol=1e-5, atol=1e-8)


# Weight-decay mask.


@pytest.mark.parametrize("decay_embeddings", [False, True])
def test_mask_on_linen_tree(decay_embeddings):
    mask = optim.weight_decay_mask(linen_params(), decay_embeddings=decay_embeddings)
    assert mask == expected_mask(decay_embeddings)


def test_mask_embed_match_is_case_insensitive_and_on_any_key():
    params = {"TokenEmbedder": {"w": jnp.zeros((3, 2))}, "pos_Embed": jnp.zeros((5, 2)),
              "dense": {"w": jnp.zeros((2, 2))}}
    mask = optim.weight_decay_mask(params, decay_embeddings=False)
    assert mask == {"TokenEmbedder": {"w": False}, "pos_Embed": False, "dense": {"w": True}}


def test_mask_on_abstract_and_boxed_trees():
    abstract = jax.eval_shape(linen_params)
    assert optim.weight_decay_mask(abstract, decay_embeddings=False) == expected_mask(False)
    boxed = jax.tree.map(lambda x: nn.LogicallyPartitioned(x, (None,) * x.ndim), linen_params())
    mask = nn.unbox(optim.weight_decay_mask(boxed, decay_embeddings=False))
    assert mask == expected_mask(False)


@pytest.mark.parametrize("decay_embeddings", [False, True])
def test_adamw_decays_only_masked_leaves(decay_embeddings):
    wd, lr = 0.1, 0.5
    c = cfg(name="adamw", lr=lr, schedule="constant", weight_decay=wd,
            decay_embeddings=decay_embeddings)
    tx, _ = optim.make_optimizer(c, 10)
    params = linen_params()
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    mask = expected_mask(decay_embeddings)
    for m, p, q in zip(jax.tree.leaves(mask), jax.tree.leaves(params), jax.tree.leaves(new),
                       strict=True):
        if m:
            np.testing.assert_allclose(q, p * (1 - lr * wd), rtol=1e-6)
        else:
            assert np.array_equal(np.asarray(q), np.asarray(p))  # bit for bit


@pytest.mark.parametrize("name", ["sgd", "lion", "adafactor"])
def test_other_optimizers_decay_only_masked_leaves(name):
    tx, _ = optim.make_optimizer(
        cfg(name=name, lr=0.5, schedule="constant", weight_decay=0.1,
            kwargs={"momentum": 0.0} if name == "sgd" else {}), 10)
    params = linen_params()
    zeros = jax.tree.map(jnp.zeros_like, params)
    new = optax.apply_updates(params, tx.update(zeros, tx.init(params), params)[0])
    kernel = params["params"]["block_0"]["attn"]["kernel"]
    # lr * wd scaling everywhere (adafactor: decay rate scaled by the schedule).
    np.testing.assert_allclose(new["params"]["block_0"]["attn"]["kernel"], kernel * 0.95, rtol=1e-6)
    for path in [("embed", "embedding"), ("block_0", "attn", "bias"), ("block_0", "norm", "scale")]:
        p, q = params["params"], new["params"]
        for k in path:
            p, q = p[k], q[k]
        assert np.array_equal(np.asarray(q), np.asarray(p)), (name, path)


def test_adamw_on_linen_boxed_tree():
    tx, _ = optim.make_optimizer(
        cfg(name="adamw", lr=0.5, schedule="constant", weight_decay=0.1), 10)
    params = jax.tree.map(lambda x: nn.LogicallyPartitioned(x, (None,) * x.ndim), linen_params())
    zeros = jax.tree.map(jnp.zeros_like, params)
    new = nn.unbox(optax.apply_updates(params, tx.update(zeros, tx.init(params), params)[0]))
    plain = linen_params()["params"]
    np.testing.assert_allclose(new["params"]["block_0"]["attn"]["kernel"],
                               plain["block_0"]["attn"]["kernel"] * 0.95, rtol=1e-6)
    assert np.array_equal(new["params"]["embed"]["embedding"], plain["embed"]["embedding"])


def test_adamw_on_nnx_state():
    class Tiny(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(V, D, rngs=rngs)
            self.dense = nnx.Linear(D, D, rngs=rngs)
            self.norm = nnx.LayerNorm(D, rngs=rngs)

    state = nnx.state(Tiny(nnx.Rngs(0)), nnx.Param)
    mask = optim.weight_decay_mask(state, decay_embeddings=False)
    flat = {"/".join(str(k.key) for k in path[:-1]): v
            for path, v in jax.tree_util.tree_flatten_with_path(mask)[0]}
    assert flat == {"dense/bias": False, "dense/kernel": True, "embed/embedding": False,
                    "norm/bias": False, "norm/scale": False}

    tx, _ = optim.make_optimizer(
        cfg(name="adamw", lr=0.5, schedule="constant", weight_decay=0.1), 10)
    zeros = jax.tree.map(jnp.zeros_like, state)
    new = optax.apply_updates(state, tx.update(zeros, tx.init(state), state)[0])
    np.testing.assert_allclose(new["dense"]["kernel"][...], state["dense"]["kernel"][...] * 0.95,
                               rtol=1e-6)
    assert np.array_equal(new["embed"]["embedding"][...], state["embed"]["embedding"][...])
    assert np.array_equal(new["norm"]["scale"][...], state["norm"]["scale"][...])
