"""The pure train step: accumulation equals the full batch, loss scaling, skipping."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jtrain import losses, precision
from jtrain import step as step_lib
from jtrain.state import TrainState


def _linear_apply(params, inputs, rng=None, train=False):
    return inputs @ params["w"] + params["b"]  # [B, T, V]


def _state(params, tx, scale=1.0):
    return TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params),
                      rng=jax.random.key_data(jax.random.key(0)),
                      loss_scale={"scale": jnp.float32(scale), "good_steps": jnp.int32(0)},
                      skipped_steps=jnp.int32(0), consecutive_skips=jnp.int32(0),
                      halted_at=jnp.int32(0), lr_factor=jnp.float32(1))


def _masked_lm_batch(rng, b=8, t=5, d=4, v=7):
    r = np.random.default_rng(rng)
    weights = (r.random((b, t)) < 0.6).astype(np.float32)
    weights[0] = 0.0  # a fully masked row: token weighting must still be exact
    weights[1] = 1.0
    return {"inputs": r.normal(size=(b, t, d)).astype(np.float32),
            "targets": r.integers(0, v, (b, t)).astype(np.int32), "weights": weights}


@pytest.mark.parametrize("k", [2, 4, 8])
def test_grad_accumulation_equals_full_batch_token_weighted(k):
    batch = _masked_lm_batch(0)
    r = np.random.default_rng(1)
    params = {"w": jnp.asarray(r.normal(size=(4, 7)), jnp.float32), "b": jnp.zeros(7)}
    tx = optax.sgd(0.5)
    full = step_lib.make_train_step(_linear_apply, losses.default_loss, tx, lambda s: 0.5)
    accum = step_lib.make_train_step(_linear_apply, losses.default_loss, tx, lambda s: 0.5,
                                     grad_accum_steps=k)
    s1, m1 = jax.jit(full)(_state(params, tx), batch)
    s2, m2 = jax.jit(accum)(_state(params, tx), batch)
    np.testing.assert_allclose(m1["train/loss"], m2["train/loss"], rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # Plain per-microbatch averaging (what optax.MultiSteps does) is NOT equal here: the
    # microbatches hold different numbers of tokens. This guards the test's power.
    micro = [jax.tree.map(lambda x: x[j::k], batch) for j in range(k)]
    mean_of_means = np.nanmean([losses.default_loss(_linear_apply(params, mb["inputs"]), mb)[0]
                             / losses.default_loss(_linear_apply(params, mb["inputs"]), mb)[1]
                             for mb in micro])
    assert abs(mean_of_means - float(m1["train/loss"])) > 1e-4


def test_accumulation_with_adamw_matches_full_batch():
    batch = _masked_lm_batch(2, b=16)
    params = {"w": jnp.ones((4, 7)) * 0.1, "b": jnp.zeros(7)}
    tx = optax.adamw(1e-2, weight_decay=0.1)
    s_full, s_acc = _state(params, tx), _state(params, tx)
    full = jax.jit(step_lib.make_train_step(_linear_apply, losses.default_loss, tx, lambda s: 0))
    acc = jax.jit(step_lib.make_train_step(_linear_apply, losses.default_loss, tx, lambda s: 0,
                                           grad_accum_steps=4))
    for _ in range(3):
        s_full, _ = full(s_full, batch)
        s_acc, _ = acc(s_acc, batch)
    for a, b in zip(jax.tree.leaves(s_full.params), jax.tree.leaves(s_acc.params)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_dynamic_loss_scale_skips_nonfinite_and_halves():
    params = {"w": jnp.ones((4, 7)), "b": jnp.zeros(7)}
    tx = optax.sgd(0.1)
    step = jax.jit(step_lib.make_train_step(_linear_apply, losses.default_loss, tx,
                                            lambda s: 0.1, dynamic_loss_scale=True))
    batch = _masked_lm_batch(3)
    # Finite inputs whose scaled gradients overflow float32 (an fp16-style overflow; a
    # non-finite input would make the batch invalid instead, see row_validity).
    bad = dict(batch, inputs=np.full_like(batch["inputs"], 1e36))
    s0 = _state(params, tx, scale=2.0 ** 15)
    s1, m = step(s0, bad)
    assert int(s1.skipped_steps) == 1 and int(s1.step) == 1
    assert float(s1.loss_scale["scale"]) == 2.0 ** 14
    np.testing.assert_array_equal(s1.params["w"], params["w"])  # update skipped
    s2, m = step(s1, batch)
    assert int(s2.skipped_steps) == 1
    assert not np.array_equal(s2.params["w"], params["w"])
    # the scale is divided out: same update as an unscaled float32 step
    plain = jax.jit(step_lib.make_train_step(_linear_apply, losses.default_loss, tx,
                                             lambda s: 0.1))
    s_ref, _ = plain(_state(params, tx), batch)
    np.testing.assert_allclose(s2.params["w"], s_ref.params["w"], rtol=1e-5)


def test_loss_scale_grows_after_interval(monkeypatch):
    ls = {"scale": jnp.float32(4.0), "good_steps": jnp.int32(precision.GROWTH_INTERVAL - 1)}
    out = precision.update_loss_scale(ls, jnp.bool_(True), True)
    assert float(out["scale"]) == 8.0 and int(out["good_steps"]) == 0
    out = precision.update_loss_scale(ls, jnp.bool_(True), False)
    assert float(out["scale"]) == 4.0


def test_eval_step_ignores_padding_and_user_mean_loss():
    r = np.random.default_rng(0)
    params = {"w": jnp.asarray(r.normal(size=(4, 3)), jnp.float32), "b": jnp.zeros(3)}
    x = r.normal(size=(6, 4)).astype(np.float32)
    y = r.integers(0, 3, 6).astype(np.int32)
    mask = np.array([1, 1, 1, 1, 0, 0], np.float32)
    garbage = dict(inputs=x.copy(), targets=y.copy(), mask=mask)
    garbage["inputs"][4:] = 1e6  # padded rows with garbage must not matter
    clean = dict(inputs=x[:4], targets=y[:4])

    def mean_loss(out, batch):
        return optax.softmax_cross_entropy_with_integer_labels(out, batch["targets"]).mean()

    for user, fn in [(False, losses.default_loss), (True, mean_loss)]:
        ev = jax.jit(step_lib.make_eval_step(_linear_apply, fn, user_loss=user))
        a, b = ev(params, garbage), ev(params, clean)
        np.testing.assert_allclose(a["loss_sum"] / a["weight"], b["loss_sum"] / b["weight"],
                                   rtol=1e-6)
        np.testing.assert_allclose(a["correct"], b["correct"])
