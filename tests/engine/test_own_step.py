"""A step of your own (jtrain.step.Step) under the engine's guarantees, against numpy: the
state after N updates equals plain SGD recomputed over the batches the run consumed (in
its order, from hashes.jsonl), evaluation scores what `evaluate` returns with jtrain's
loss, a non-finite update leaves the state as it was and is counted, `context.step`
counts applied updates, and an impure `init` is one line."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jtrain
from jtrain import errors, losses
from jtrain.step import Step

LR, BATCH, STEPS = 0.05, 16, 8
W_TRUE = np.array([1.0, -2.0, 0.5], np.float32)


def data(n=128, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    return {"inputs": x, "targets": x @ W_TRUE + rng.normal(0, 0.1, n).astype(np.float32)}


def make(impure: bool = False) -> Step:
    def init(rng, example):
        w = jnp.zeros(3) if not impure else jnp.asarray(np.random.normal(size=3), jnp.float32)
        return {"w": w, "applied": jnp.zeros((), jnp.int32)}

    def update(state, batch, rng, context):
        # The documented convention: padding rows (data.drop_last=False) weigh 0.
        weights = losses.weights_for(batch, batch["targets"].shape)

        def loss(w):
            return (weights * (batch["inputs"] @ w - batch["targets"]) ** 2).sum() / weights.sum()

        value, grad = jax.value_and_grad(loss)(state["w"])
        return ({"w": state["w"] - LR * context.lr_factor * grad,
                 "applied": context.step + 1},
                {"loss": value, "w0": state["w"][0], "lr_factor": context.lr_factor})

    def evaluate(state, batch):
        return batch["inputs"] @ state["w"]

    return Step(init=init, update=update, evaluate=evaluate, name="sgd")


def config(**over):
    cfg = {"seed": 0, "total_steps": STEPS, "data": {"batch_size": BATCH},
           "eval": {"every_steps": STEPS, "metrics": ["loss"]},
           "debug": {"hash_every_steps": 1}, "log": {"every_steps": 1,
                                                     "writers": ("jsonl",)}}
    cfg.update(over)
    return cfg


def numpy_sgd(workdir, d, skip=()):
    with open(os.path.join(workdir, "hashes.jsonl")) as f:
        rows = sorted((json.loads(line) for line in f), key=lambda r: r["step"])
    w = np.zeros(3)
    for r in rows:
        if r["step"] in skip:
            continue
        x, y = d["inputs"][r["examples"]].astype(np.float64), d["targets"][r["examples"]]
        w = w - LR * 2 * x.T @ (x @ w - y) / len(y)
    return w


def check_against_numpy(tmp_path):
    train, ev = data(), data(40, seed=1)
    result = jtrain.train(config(), str(tmp_path), step=make(), train_data=train,
                          eval_data=ev)
    w = np.asarray(result.state.params["w"], np.float64)
    np.testing.assert_allclose(w, numpy_sgd(tmp_path, train), rtol=1e-5)
    assert int(result.state.params["applied"]) == STEPS
    mse = ((ev["inputs"] @ w - ev["targets"]) ** 2).mean()
    np.testing.assert_allclose(result.history[-1]["eval/loss"], mse, rtol=1e-5)
    return result


def test_own_step_equals_numpy_sgd_and_eval_scores_evaluate(tmp_path):
    check_against_numpy(tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text()
               .splitlines()]
    assert all("train/w0" in r for r in records if "train/loss" in r)


def test_a_non_finite_update_leaves_the_state_and_is_counted(tmp_path):
    train = data()
    ev = data(40, seed=1)  # given: the train array is not split (hashes index into it)
    jtrain.train(config(total_steps=3), str(tmp_path / "clean"), step=make(),
                 train_data=train, eval_data=ev)
    with open(tmp_path / "clean" / "hashes.jsonl") as f:
        row = [r for r in map(json.loads, f) if r["step"] == 3][0]["examples"][0]
    train["targets"][row] = 1e30  # finite data, but its squared error overflows: inf loss
    result = jtrain.train(config(), str(tmp_path), step=make(), train_data=train,
                          eval_data=ev)
    with open(tmp_path / "hashes.jsonl") as f:
        skipped = {r["step"] for r in map(json.loads, f) if row in r["examples"]}
    assert len(skipped) == 1 and result.summary["skipped_steps"] == 1
    # context.step counts applied updates: the skipped one does not move it
    assert int(result.state.params["applied"]) == STEPS - 1
    w = np.asarray(result.state.params["w"], np.float64)
    np.testing.assert_allclose(w, numpy_sgd(tmp_path, train, skip=skipped), rtol=1e-5)


def test_a_step_passed_as_the_model_trains_the_same(tmp_path):
    a = jtrain.train(config(), str(tmp_path / "a"), step=make(), train_data=data())
    b = jtrain.train(config(), str(tmp_path / "b"), model=make(), train_data=data())
    assert jtrain.state_sha256(a.state) == jtrain.state_sha256(b.state)


def test_an_impure_init_is_one_line(tmp_path):
    with pytest.raises(errors.ModelError) as caught:
        jtrain.train(config(), str(tmp_path), step=make(impure=True), train_data=data())
    assert errors.render(caught.value) == (
        "jtrain: model error: step sgd: init(rng, example) gave different states for the "
        "same rng: make it a pure function of its arguments (draw randomness from rng, not "
        "numpy or Python)")


ELASTIC = '''
import sys
sys.path.insert(0, sys.argv[1])
import jax, jtrain, test_own_step as t
assert jax.device_count() == 4
jtrain.train(t.config(checkpoint={"every_steps": 2}), "run", step=t.make(),
             train_data=t.data(), eval_data=t.data(40, seed=1))
'''


def test_elastic_resume_from_4_devices_onto_1(tmp_path):
    """Saved on 4 devices (stopped by SIGTERM after step 5), resumed here on 1: the same
    state as an uninterrupted run on 1 device, to float32 rounding."""
    import subprocess
    import sys

    from jtrain.control import faults

    (tmp_path / "four.py").write_text(ELASTIC)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu", **{faults.FAULT_ENV: "step:5:TERM"})
    proc = subprocess.run([sys.executable, "four.py", os.path.dirname(__file__)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["step"] == 5
    resumed = jtrain.train(config(checkpoint={"every_steps": 2}), str(tmp_path / "run"),
                           step=make(), train_data=data(), eval_data=data(40, seed=1))
    assert resumed.summary["resumed_from"] == 5
    straight = jtrain.train(config(), str(tmp_path / "one"), step=make(), train_data=data(),
                            eval_data=data(40, seed=1))
    np.testing.assert_allclose(np.asarray(resumed.state.params["w"]),
                               np.asarray(straight.state.params["w"]), rtol=1e-6)
    assert int(resumed.state.params["applied"]) == STEPS


def test_plateau_reaches_the_step_and_early_stopping_reads_its_eval(tmp_path):
    """ReduceLROnPlateau's factor arrives as context.lr_factor (halved after each eval
    that does not improve on the best by min_delta); early stopping stops on
    `evaluate`'s eval."""
    plateau = config(eval={"every_steps": 2, "metrics": ["loss"]},
                     plateau={"monitor": "eval/loss", "patience": 0, "factor": 0.5,
                              "min_delta": 1e9})
    jtrain.train(plateau, str(tmp_path / "p"), step=make(), train_data=data(),
                 eval_data=data(40, seed=1))
    factors = {r["step"]: r["train/lr_factor"] for r in map(
        json.loads, (tmp_path / "p" / "metrics.jsonl").read_text().splitlines())
        if "train/lr_factor" in r}
    # the eval at step 2 sets the best; each later eval (4, 6) improves by less than
    # min_delta and halves the factor the next steps read
    assert [factors[s] for s in range(1, 9)] == [1.0] * 4 + [0.5] * 2 + [0.25] * 2, factors
    stop = config(eval={"every_steps": 2, "metrics": ["loss"]},
                  early_stop={"monitor": "eval/loss", "stopping_threshold": 1e9})
    result = jtrain.train(stop, str(tmp_path / "s"), step=make(), train_data=data(),
                          eval_data=data(40, seed=1))
    assert result.stopped_by is not None and result.summary["step"] == 2


PADDED = {"batch_size": 32, "drop_last": False, "shuffle": False}


def numpy_partial_batches(train, epochs=2):
    """SGD over 100 rows in batches of 32, in order, the last of each epoch its 4 rows."""
    w = np.zeros(3)
    for _ in range(epochs):  # rows 0-31, 32-63, 64-95, 96-99
        for lo in range(0, 100, 32):
            x = train["inputs"][lo:lo + 32].astype(np.float64)
            y = train["targets"][lo:lo + 32]
            w = w - LR * 2 * x.T @ (x @ w - y) / len(y)
    return w


def test_a_padded_last_batch_reaches_update_marked(tmp_path):
    """data.drop_last=False: 100 rows in batches of 32, so each epoch ends with a batch
    of 4 real rows padded to 32. The row mask reaches `update`; a loss weighted by
    losses.weights_for equals SGD over the true partial batches."""
    train = data(100)
    result = jtrain.train(config(total_steps=8, data=PADDED), str(tmp_path), step=make(),
                          train_data=train, eval_data=data(40, seed=1))
    np.testing.assert_allclose(np.asarray(result.state.params["w"]),
                               numpy_partial_batches(train), rtol=1e-5)
    # tokens/s counts the real rows: its ratio to examples/s (the batch size) per step
    ratio = {r["step"]: r["perf/tokens_per_sec"] / r["perf/examples_per_sec"] for r in map(
        json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
        if "perf/tokens_per_sec" in r}
    np.testing.assert_allclose([ratio[s] for s in range(1, 9)], [1, 1, 1, 4 / 32] * 2)


def test_a_step_without_evaluate_under_val_fraction_is_one_line(tmp_path):
    """No eval data given: data.val_fraction's hold-out is what would be evaluated, and
    the line names it; with val_fraction 0 the same step trains on all the data."""
    blind = Step(init=make().init, update=make().update, name="sgd")
    with pytest.raises(errors.ConfigError) as caught:
        jtrain.train(config(data={"batch_size": BATCH, "val_fraction": 0.1}), str(tmp_path),
                     step=blind, train_data=data())
    assert errors.render(caught.value) == (
        "jtrain: config error: data.val_fraction: 0.1 of the train data is held out for eval "
        "(no eval data was given) but step sgd has no evaluate(state, batch) -> outputs; "
        "add one, or set data.val_fraction=0 to train on all of it")
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before the first step
    with pytest.raises(errors.ModelError, match=r"the run evaluates \(eval data is given\)"):
        jtrain.train(config(), str(tmp_path / "given"), step=blind, train_data=data(),
                     eval_data=data(40, seed=1))
    train = data()
    result = jtrain.train(config(data={"batch_size": BATCH, "val_fraction": 0.0}),
                          str(tmp_path / "all"), step=blind, train_data=train)
    np.testing.assert_allclose(np.asarray(result.state.params["w"], np.float64),
                               numpy_sgd(tmp_path / "all", train), rtol=1e-5)


def marked(n, seed, bad_row=None):
    d = data(n, seed)
    d["bad"] = np.zeros(n, np.int32)
    if bad_row is not None:
        d["bad"][bad_row] = 1
    return d


def make_blowup(grad_norm: bool) -> Step:
    """SGD whose new state is inf on a batch holding a row marked bad, while the loss (of
    the state before the update) stays finite; with `grad_norm` it also reports a finite
    gradient norm, as a step logging train/grad_norm does."""
    def update(state, batch, rng, context):
        def loss(w):
            return ((batch["inputs"] @ w - batch["targets"]) ** 2).mean()

        value, grad = jax.value_and_grad(loss)(state["w"])
        step = LR * grad / (1 - batch["bad"].max())  # x / 0: inf on the bad batch
        metrics = {"loss": value, **({"grad_norm": jnp.linalg.norm(grad)} if grad_norm
                                     else {})}
        return {"w": state["w"] - step, "applied": context.step + 1}, metrics

    return Step(init=make().init, update=update, evaluate=make().evaluate, name="blowup")


@pytest.mark.parametrize("grad_norm", [False, True], ids=["state", "state_and_grad_norm"])
def test_a_non_finite_state_under_a_finite_loss_is_skipped(tmp_path, grad_norm):
    """The guard looks at the state update returns, not only its loss (nor only a
    grad_norm metric it reports): the batch that makes it inf is skipped and counted,
    and the rest is plain SGD over the other batches."""
    train = marked(128, 0, bad_row=40)  # unshuffled batches of 16: step 3 holds row 40
    cfg = config(data={"batch_size": BATCH, "shuffle": False})
    result = jtrain.train(cfg, str(tmp_path), step=make_blowup(grad_norm), train_data=train,
                          eval_data=marked(40, 1))
    assert result.summary["skipped_steps"] == 1
    assert int(result.state.params["applied"]) == STEPS - 1
    ledger = [json.loads(line) for line in (tmp_path / "skipped.jsonl").read_text()
              .splitlines()]
    assert [(r["step"], r["examples"]) for r in ledger] == [(3, list(range(32, 48)))]
    np.testing.assert_allclose(np.asarray(result.state.params["w"], np.float64),
                               numpy_sgd(tmp_path, train, skip={3}), rtol=1e-5)


def residual_variance(outputs, batch):
    """A batch-level loss: the variance of the residuals over the batch's rows."""
    r = outputs - batch["targets"]
    return ((r - r.mean()) ** 2).mean()


def test_eval_of_a_batch_level_loss_scores_the_real_rows_only(tmp_path):
    """loss.eval_scope = "batch": 40 eval rows in batches of 16 end with 8 real rows
    padded to 16; `evaluate`'s outputs are scored on those 8 rows alone, and the batch
    values average weighted by their rows, as numpy computes over the slices."""
    ev = data(40, seed=1)
    result = jtrain.train(config(loss={"eval_scope": "batch"}), str(tmp_path), step=make(),
                          train_data=data(), eval_data=ev, loss_fn=residual_variance)
    w = np.asarray(result.state.params["w"], np.float64)
    r = ev["inputs"] @ w - ev["targets"]
    parts = [r[lo:lo + BATCH] for lo in range(0, 40, BATCH)]  # 16, 16, 8 rows
    expected = sum(len(p) * p.var() for p in parts) / 40
    np.testing.assert_allclose(result.history[-1]["eval/loss"], expected, rtol=1e-5)


def test_under_val_fraction_the_records_name_rows_of_the_data_given(tmp_path):
    """No eval data given: data.val_fraction holds a quarter out, and the example indices
    of hashes.jsonl and the skip ledger still index the arrays the user passed: SGD in
    numpy over those rows (less the skipped steps) is the state, and the skipped step's
    examples hold the row that overflowed."""
    train = data()
    train["targets"][100] = 1e30  # finite data, but its squared error overflows: inf loss
    result = jtrain.train(config(data={"batch_size": BATCH, "val_fraction": 0.25}),
                          str(tmp_path), step=make(), train_data=train)
    with open(tmp_path / "hashes.jsonl") as f:
        with_row = {r["step"] for r in map(json.loads, f) if 100 in r["examples"]}
    ledger = [json.loads(line) for line in (tmp_path / "skipped.jsonl").read_text()
              .splitlines()]
    assert with_row and {r["step"] for r in ledger} == with_row
    assert all(100 in r["examples"] for r in ledger)
    np.testing.assert_allclose(np.asarray(result.state.params["w"], np.float64),
                               numpy_sgd(tmp_path, train, skip=with_row), rtol=1e-5)


def make_accumulating(k: int) -> Step:
    """The SGD step with its gradient summed over k microbatches by
    jtrain.step.accumulated (the built-in update's accumulation), token-weighted."""
    from jtrain.step import accumulated

    def loss_and_sums(w, batch, key, scale):
        weights = losses.weights_for(batch, batch["targets"].shape)
        total = (weights * (batch["inputs"] @ w - batch["targets"]) ** 2).sum()
        return total * scale, (total, weights.sum())

    grad_sums = accumulated(jax.value_and_grad(loss_and_sums, has_aux=True), k)

    def update(state, batch, rng, context):
        (total, weight), grad = grad_sums(state["w"], batch, rng, 1.0)
        return ({"w": state["w"] - LR * grad / weight, "applied": context.step + 1},
                {"loss": total / weight})

    return Step(init=make().init, update=update, evaluate=make().evaluate, name="sgd")


def test_accumulation_is_the_steps_own_and_exact_under_padding(tmp_path):
    """optim.grad_accum_steps configures the built-in update: one line before the first
    step. Accumulating inside `update` (4 microbatches of 8 rows, strided, so each holds
    one of the padded batch's 4 real rows) equals SGD over the true partial batches."""
    with pytest.raises(errors.ConfigError) as caught:
        jtrain.train(config(optim={"grad_accum_steps": 4}, data=PADDED), str(tmp_path / "x"),
                     step=make_accumulating(4), train_data=data(100))
    assert errors.render(caught.value) == (
        "jtrain: config error: optim.grad_accum_steps: configures the built-in update; with "
        "a step of your own (step.factory: sgd), accumulate inside update "
        "(jtrain.step.accumulated)")
    assert not (tmp_path / "x" / "metrics.jsonl").exists()
    train = data(100)
    result = jtrain.train(config(total_steps=8, data=PADDED), str(tmp_path),
                          step=make_accumulating(4), train_data=train,
                          eval_data=data(40, seed=1))
    np.testing.assert_allclose(np.asarray(result.state.params["w"]),
                               numpy_partial_batches(train), rtol=1e-5)
