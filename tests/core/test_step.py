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
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # Plain per-microbatch averaging (what optax.MultiSteps does) is NOT equal here: the
    # microbatches hold different numbers of tokens. This guards the test's power.
    micro = [jax.tree.map(lambda x, j=j: x[j::k], batch) for j in range(k)]
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
    for a, b in zip(jax.tree.leaves(s_full.params), jax.tree.leaves(s_acc.params), strict=True):
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
    garbage = {"inputs": x.copy(), "targets": y.copy(), losses.ROW_MASK: mask}
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


def _adamw_run(batches, **kw):
    """Params after the train steps on `batches` (adamw: its moments see every update)."""
    params = {"w": jnp.asarray(np.random.default_rng(5).normal(size=(4, 7)), jnp.float32),
              "b": jnp.zeros(7)}
    tx = optax.adamw(1e-2, weight_decay=0.1)
    step = jax.jit(step_lib.make_train_step(_linear_apply, losses.default_loss, tx,
                                            lambda s: 1e-2, **kw))
    state, out = _state(params, tx), []
    for batch in batches:
        state, m = step(state, batch)
        out.append(m)
    return params, state, out


@pytest.mark.parametrize("how", ["valid_field", "valid_fn"])
def test_invalid_rows_do_not_move_the_params(how):
    """A batch whose rows are all invalid (data.valid_fn False: on a `valid` field of
    the user's, or on the inputs) leaves
    params and optimizer state as they were; so does one where only the invalid rows
    carry a huge (finite) loss: the next good step is the one a run without it takes."""
    clean, clean2 = _masked_lm_batch(10), _masked_lm_batch(11)
    all_bad = dict(clean, inputs=clean["inputs"] * 1e4)
    some_bad = dict(clean, inputs=clean["inputs"].copy())
    some_bad["inputs"][[2, 5]] = 1e4  # a huge loss in rows 2 and 5 only
    rows = np.ones(8, np.int32)
    rows[[2, 5]] = 0
    if how == "valid_field":
        all_bad["valid"] = np.zeros(8, np.int32)
        some_bad["valid"] = rows
        ones = np.ones(8, np.int32)
        clean, clean2 = dict(clean, valid=ones), dict(clean2, valid=ones)
        kw = {"valid_fn": lambda b: b["valid"] != 0}  # a field has no meaning by its name
    else:  # rows whose inputs exceed 1e3 are invalid to the user's check
        kw = {"valid_fn": lambda b: (jnp.abs(b["inputs"]) < 1e3).reshape(
            b["inputs"].shape[0], -1).all(axis=1)}
    params, _, _ = _adamw_run([], **kw)
    for bad in (all_bad, some_bad):
        _, state, (m,) = _adamw_run([bad], **kw)
        for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params), strict=True):
            np.testing.assert_array_equal(a, b)
        assert int(state.skipped_steps) == 1 and int(state.step) == 1
        assert int(m["train/status"]) & step_lib.INVALID_BATCH
        expected_rows = np.zeros(8, bool) if bad is all_bad else rows.astype(bool)
        np.testing.assert_array_equal(m["train/rows_ok"], expected_rows)
        # optimizer state untouched too: the next good batches give the run without `bad`
        _, with_bad, _ = _adamw_run([clean, bad, clean2], **kw)
        _, without, _ = _adamw_run([clean, clean2], **kw)
        for a, b in zip(jax.tree.leaves(with_bad.params), jax.tree.leaves(without.params),
                        strict=True):
            np.testing.assert_array_equal(a, b)
        assert int(with_bad.step) == 3 and int(without.step) == 2


@pytest.mark.slow  # seconds of CPU: the full suite runs it (tests/README.md)
def test_loss_terms_are_summed_exactly_across_microbatches():
    """train/<term> of a multi-term loss with grad_accum_steps=2 equals the full batch's
    weighted value when the microbatches weigh differently (not the mean of the
    per-microbatch means)."""
    batch = _masked_lm_batch(12, b=8)
    batch["weights"][0::2] = 1.0  # microbatch 0 (rows 0, 2, ...): every token
    batch["weights"][1::2] = 0.0  # microbatch 1: one token per row
    batch["weights"][1::2, 0] = 1.0
    batch["scale"] = np.arange(8, dtype=np.float32)[:, None] * np.ones((8, 5), np.float32)

    def two_terms(out, b):
        ce, w = losses.default_loss(out, b)
        sq = ((out ** 2).mean(-1) * b["scale"] * b["weights"]).sum()
        return (ce, w), {"ce": (ce, w), "sq": (sq, b["weights"].sum())}

    params = {"w": jnp.asarray(np.random.default_rng(3).normal(size=(4, 7)), jnp.float32),
              "b": jnp.zeros(7)}
    tx = optax.sgd(0.1)
    got = {}
    for k in (1, 2):
        step = jax.jit(step_lib.make_train_step(_linear_apply, two_terms, tx, lambda s: 0.1,
                                                grad_accum_steps=k))
        got[k] = step(_state(params, tx), batch)[1]
    out = _linear_apply(params, batch["inputs"])
    for name in ("ce", "sq"):
        (s, w), = [two_terms(out, batch)[1][name]]
        np.testing.assert_allclose(got[2][f"train/{name}"], s / w, rtol=1e-6)
        np.testing.assert_allclose(got[2][f"train/{name}"], got[1][f"train/{name}"], rtol=1e-6)
        micro = [jax.tree.map(lambda x, j=j: x[j::2], batch) for j in range(2)]
        means = [float(np.divide(*two_terms(_linear_apply(params, mb["inputs"]), mb)[1][name]))
                 for mb in micro]
        assert abs(np.mean(means) - float(s / w)) > 1e-3  # the test can tell them apart


def test_train_metrics_merge_over_microbatches_to_the_full_batch():
    """log.train_metrics with grad_accum_steps=4: train/accuracy and train/mse of the
    whole batch (counts merged), not the last microbatch's nor a mean of means."""
    from jtrain.metrics import EvalSpec

    r = np.random.default_rng(7)
    batch = {"inputs": r.normal(size=(16, 5, 4)).astype(np.float32),
             "targets": r.integers(0, 7, (16, 5)).astype(np.int32),
             "weights": np.ones((16, 5), np.float32)}
    batch["weights"][1::4] = 0.0  # microbatch 1 (rows 1, 5, ...) weighs nothing
    batch["weights"][2::4, 1:] = 0.0  # microbatch 2: one token per row
    params = {"w": jnp.asarray(r.normal(size=(4, 7)), jnp.float32), "b": jnp.zeros(7)}
    tx = optax.sgd(0.0)
    spec = EvalSpec(task="sequence", names=("accuracy",), num_classes=7)
    got = {}
    for k in (1, 4):
        step = jax.jit(step_lib.make_train_step(_linear_apply, losses.default_loss, tx,
                                                lambda s: 0.0, grad_accum_steps=k,
                                                train_metrics=spec))
        got[k] = step_lib.train_metric_values(
            jax.device_get(step(_state(params, tx), batch)[1][step_lib.TRAIN_METRICS]))
    pred = np.argmax(np.asarray(_linear_apply(params, batch["inputs"])), -1)
    hits = (pred == batch["targets"]) * batch["weights"]
    want = hits.sum() / batch["weights"].sum()
    assert got[1]["train/accuracy"] == pytest.approx(want, abs=1e-7)
    assert got[4]["train/accuracy"] == pytest.approx(want, abs=1e-7)
    last = slice(3, None, 4)  # the guard's power: the last microbatch alone differs
    assert abs(hits[last].sum() / batch["weights"][last].sum() - want) > 1e-3


def test_the_state_hash_covers_integer_leaves():
    from jtrain.state import state_sha256

    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    tx = optax.adam(1e-3)
    state = _state(params, tx)
    base = state_sha256(state)
    assert state_sha256(_state(params, tx)) == base
    count = jax.tree.map(lambda x: x + 1 if x.dtype == jnp.int32 else x, state.opt_state)
    assert [x.dtype for x in jax.tree.leaves(state.opt_state)].count(jnp.int32) == 1
    assert state_sha256(state.replace(opt_state=count)) != base  # adam's step counter
    # an integer leaf of the model's own state (a counter kept beside the params)
    counted = state.replace(model_state={"seen": jnp.int32(3)})
    assert state_sha256(counted) != state_sha256(
        state.replace(model_state={"seen": jnp.int32(4)}))
