"""Every number jtrain reports for a user's own model and loss equals an independent
computation (numpy) over exactly the data given: the user's field names are theirs
(`mask`, `valid`, `weights`, `targets` in every position), batch-scope eval is
count-weighted and never scores padding, scalar outputs pass through eval, element-wise
weights work with the default loss, and a NaN target under weight 0 is a missing value
(no skipped update). The model is a pure (init, apply) pair with fixed parameters and
the optimizer's learning rate is 0, so numpy knows the parameters eval used.

`tests/engine/test_exactness_multidevice.py` runs the eval-size rows on 8 devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jtrain
from jtrain import losses

F, OUT = 3, 2  # features in, outputs
W = np.array([[0.5, -1.0], [2.0, 0.25], [-0.75, 1.5]], np.float32)
B0 = np.array([0.1, -0.2], np.float32)


def linear():
    """A pure (init, apply) pair: y = x W + b, the parameters fixed (no randomness)."""
    def init(rng, inputs):
        return {"w": jnp.asarray(W), "b": jnp.asarray(B0)}

    def apply(params, inputs, rng=None, train=False):
        x = inputs["x"] if isinstance(inputs, dict) else inputs
        return x @ params["w"] + params["b"]

    return init, apply


def cfg(batch=8, **over):
    c = {"total_steps": 1, "data": {"batch_size": batch, "shuffle": False},
         "eval": {"every_steps": 0, "batch_size": batch},
         "log": {"every_steps": 1, "verbosity": 0, "writers": ("jsonl",)},
         "optim": {"name": "sgd", "lr": 0.0, "schedule": "constant"}}
    for k, v in over.items():
        c[k] = {**c.get(k, {}), **v} if isinstance(v, dict) else v
    return c


def data(n, seed=0):
    r = np.random.default_rng(seed)
    x = r.normal(size=(n, F)).astype(np.float32)
    y = (x @ W + B0 + r.normal(size=(n, OUT))).astype(np.float32)
    return {"x": x, "targets": y, "mask": (r.random(n) > 0.4).astype(np.float32),
            "valid": np.zeros(n, np.float32), "weights": r.random(n).astype(np.float32)}


def final_eval(tmp_path, config, eval_data, **kw):
    res = jtrain.train(config, str(tmp_path / "run"), model=linear(), eval_data=eval_data,
                       train_data=kw.pop("train_data", data(16, seed=9)), **kw)
    return res.history[-1]


def err2(d):
    return ((d["x"] @ W + B0 - d["targets"]) ** 2).astype(np.float64)  # [n, OUT]


SIZES = (1, 7, 9, 28)  # 1, batch - 1, batch + 1, 3 * batch + 4 with batches of 8


@pytest.mark.parametrize("n", SIZES)
def test_batch_scope_mean_loss_is_count_weighted_and_never_scores_padding(tmp_path, n):
    """A scalar-mean loss that knows nothing of padding, scored over whole batches: the
    eval loss is the mean over exactly the n eval examples (padding would pull it
    towards row 0's error; an unweighted mean of batch means is another number)."""
    ev = data(n, seed=1)

    def loss_fn(out, batch):  # a batch mean: ignores every weight and mask
        return jnp.mean((out - batch["targets"]) ** 2)

    got = final_eval(tmp_path, cfg(loss={"eval_scope": "batch"}), ev, loss_fn=loss_fn)
    np.testing.assert_allclose(got["eval/loss"], err2(ev).mean(), rtol=2e-6)


@pytest.mark.parametrize("n", SIZES)
def test_batch_scope_loss_dict_terms_exact(tmp_path, n):
    """Named terms of a batch-scope loss (means and (sum, weight) pairs) are exact too."""
    ev = data(n, seed=2)

    def loss_fn(out, batch):
        e = (out - batch["targets"]) ** 2
        return e.mean(), {"first": e[:, 0].mean(), "second": (e[:, 1].sum(), e.shape[0])}

    got = final_eval(tmp_path, cfg(loss={"eval_scope": "batch"}), ev, loss_fn=loss_fn)
    e = err2(ev)
    np.testing.assert_allclose(got["eval/first"], e[:, 0].mean(), rtol=2e-6)
    np.testing.assert_allclose(got["eval/second"], e[:, 1].mean(), rtol=2e-6)


@pytest.mark.parametrize("scope", ["batch", "example"])
def test_a_field_named_mask_is_the_users(tmp_path, scope):
    """Per-example weights in the user's field `mask`: the masked MSE, in both eval
    scopes (the engine's padding mask used to overwrite the field: 0-1 row padding
    instead of the user's weights, or a KeyError in example scope)."""
    ev = data(28, seed=3)

    def loss_fn(out, batch):
        return losses.mse(out, batch["targets"], weights=batch["mask"])

    got = final_eval(tmp_path, cfg(loss={"eval_scope": scope}), ev, loss_fn=loss_fn)
    m = ev["mask"][:, None]
    want = (err2(ev) * m).sum() / (m.sum() * OUT)
    np.testing.assert_allclose(got["eval/loss"], want, rtol=2e-6)


def test_every_field_reaches_model_and_loss_unchanged(tmp_path):
    """Fields named mask, valid, weights, targets reach the model (no `inputs` field:
    the whole batch) and the loss as the dataset yielded them; `valid` all zeros skips
    nothing (it has no meaning by its name); the model's `[B, T]` token mask named
    `mask`, picked by data.model_inputs, is the user's, not a row mask."""
    n, t = 12, 5
    r = np.random.default_rng(4)
    tok = {"tokens": r.normal(size=(n, t)).astype(np.float32),
           "mask": (r.random((n, t)) > 0.3).astype(np.float32),
           "valid": np.zeros((n, t), np.float32),
           "weights": np.ones(n, np.float32), "targets": r.normal(size=n).astype(np.float32)}
    seen = {}

    def init(rng, inputs):
        seen["fields"] = sorted(inputs)
        seen["mask_shape"] = inputs["mask"].shape
        return {"s": jnp.float32(1.0)}

    def apply(params, inputs, rng=None, train=False):  # masked token mean
        m = inputs["mask"]
        return params["s"] * (inputs["tokens"] * m).sum(1) / jnp.maximum(m.sum(1), 1)

    def loss_fn(out, batch):
        assert set(batch) >= {"tokens", "mask", "valid", "weights", "targets"}
        return losses.mse(out, batch["targets"], weights=batch["weights"])

    config = cfg(batch=4, data={"batch_size": 4, "model_inputs": ("tokens", "mask")},
                 total_steps=2, optim={"lr": 0.1})
    res = jtrain.train(config, str(tmp_path / "run"), model=(init, apply), train_data=tok,
                       eval_data=tok, loss_fn=loss_fn)
    assert seen["fields"] == ["mask", "tokens"] and seen["mask_shape"][1:] == (t,)
    m = res.history[-1]
    assert res.summary["skipped_steps"] == 0
    pred = (tok["tokens"] * tok["mask"]).sum(1) / np.maximum(tok["mask"].sum(1), 1)
    final = jax.tree.leaves(res.state.params)[0]  # s after two steps of sgd
    np.testing.assert_allclose(m["eval/loss"],
                               ((float(final) * pred - tok["targets"]) ** 2).mean(),
                               rtol=2e-6)


def test_scalar_output_passes_through_eval(tmp_path):
    """An output dict holding a scalar regulariser: eval scores `mean(err) + reg`
    exactly (it used to fail after training: every output leaf was vmapped)."""
    ev = data(9, seed=5)
    init, _ = linear()

    def apply(params, x, rng=None, train=False):
        return {"y": x @ params["w"] + params["b"], "reg": jnp.mean(params["w"] ** 2)}

    def loss_fn(out, batch):
        return jnp.mean((out["y"] - batch["targets"]) ** 2) + out["reg"]

    res = jtrain.train(cfg(), str(tmp_path / "run"), model=(init, apply),
                       train_data={"inputs": data(16)["x"], "targets": data(16)["targets"]},
                       eval_data={"inputs": ev["x"], "targets": ev["targets"]},
                       loss_fn=loss_fn)
    want = err2(ev).mean() + (W.astype(np.float64) ** 2).mean()
    np.testing.assert_allclose(res.history[-1]["eval/loss"], want, rtol=2e-6)


def test_elementwise_weights_with_the_default_loss(tmp_path):
    """`weights` [B, OUT] matching the targets: the default MSE weighs each element
    (it used to fail at step 1: the weights were broadcast to [B])."""
    ev = data(9, seed=6)
    w = (np.random.default_rng(6).random((9, OUT)) > 0.3).astype(np.float32)
    d = {"inputs": ev["x"], "targets": ev["targets"], "weights": w}
    got = final_eval(tmp_path, cfg(), d, train_data=d)
    np.testing.assert_allclose(got["eval/loss"], (err2(ev) * w).sum() / w.sum(), rtol=2e-6)
    np.testing.assert_allclose(got["eval/mse"], (err2(ev) * w).sum() / w.sum(), rtol=2e-6)


def test_nan_targets_under_weight_zero_are_missing_values(tmp_path):
    """NaN targets with weight 0 (the documented way to mark a missing value) skip no
    update: the run trains exactly as the same data with those targets set to 0, and
    the eval loss is the weighted MSE over the present values."""
    d = data(32, seed=7)
    w = (np.random.default_rng(7).random((32, OUT)) > 0.3).astype(np.float32)
    holes = {"inputs": d["x"], "targets": np.where(w > 0, d["targets"], np.nan), "weights": w}
    zeros = dict(holes, targets=np.where(w > 0, d["targets"], 0.0).astype(np.float32))
    config = cfg(total_steps=6, optim={"lr": 0.05})
    a = jtrain.train(config, str(tmp_path / "a"), model=linear(), train_data=holes,
                     eval_data=holes)
    b = jtrain.train(config, str(tmp_path / "b"), model=linear(), train_data=zeros,
                     eval_data=zeros)
    assert a.summary["skipped_steps"] == 0
    for x, y in zip(jax.tree.leaves(a.state.params), jax.tree.leaves(b.state.params),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert a.history[-1]["eval/loss"] == b.history[-1]["eval/loss"]
    assert np.isfinite(a.history[-1]["eval/r2"])


def test_a_dataset_yielding_the_engines_key_is_refused(tmp_path):
    d = data(16)
    bad = {"x": d["x"], "targets": d["targets"], losses.ROW_MASK: np.ones(16, np.float32)}
    with pytest.raises(jtrain.DataError, match="engine's row mask"):
        jtrain.train(cfg(), str(tmp_path / "run"), model=linear(), train_data=bad)
