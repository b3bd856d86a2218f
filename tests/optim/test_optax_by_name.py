"""Optimizers that open: any optax / optax.contrib function named in the config
(`optim.name = "optax.lion"`, `optim.kwargs`) and `jtrain.train(tx=...)` train exactly as
a hand-written optax loop over the same batches; a run with `tx` stopped at a checkpoint
resumes bitwise; bad names, arguments and ignored keys are one ConfigError before step 1.
The built-in names stay pinned to optax's own optimizers by test_optimizer_families.py."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jtrain
from jtrain.errors import ConfigError

N, B, STEPS, LR = 48, 8, 6, 0.01
W0 = np.random.default_rng(0).normal(size=(3, 2)).astype(np.float32)


def _model():
    """A pure (init, apply) pair with fixed initial parameters: the hand loop starts
    from the same ones."""
    def init(rng, inputs):
        return {"w": jnp.asarray(W0), "b": jnp.zeros(2, jnp.float32)}

    def apply(params, x, rng=None, train=False):
        return x @ params["w"] + params["b"]

    return init, apply


def _loss(out, batch):
    return jnp.mean((out - batch["targets"]) ** 2)


def _data():
    r = np.random.default_rng(1)
    x = r.normal(size=(N, 3)).astype(np.float32)
    return {"inputs": x, "targets": (x @ r.normal(size=(3, 2)) + 0.5).astype(np.float32)}


def _config(**optim):
    return {"total_steps": STEPS, "data": {"batch_size": B, "shuffle": False},
            "eval": {"every_steps": 0, "batch_size": B},
            "log": {"every_steps": 1, "verbosity": 0, "writers": ("jsonl",)},
            "optim": optim}


def _hand_loop(tx, steps=STEPS):
    """optax's own loop over the batches jtrain takes in order (shuffle off)."""
    d, (_, apply) = _data(), _model()
    params = {"w": jnp.asarray(W0), "b": jnp.zeros(2, jnp.float32)}
    opt_state = tx.init(params)
    for i in range(steps):
        batch = {k: v[i * B:(i + 1) * B] for k, v in d.items()}
        grads = jax.grad(lambda p, b: _loss(apply(p, b["inputs"]), b))(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params


def _train(workdir, config, **kw):
    d = _data()
    return jtrain.train(config, str(workdir), model=_model(), train_data=d, eval_data=d,
                        loss_fn=_loss, **kw)


def _assert_params(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-7)


def _user_tx():
    return optax.chain(optax.clip_by_global_norm(0.5),
                       optax.adabelief(optax.cosine_decay_schedule(0.05, STEPS)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("optax")
    by_name = _train(root / "name", _config(
        name="optax.lion", kwargs={"b2": 0.99}, lr=LR, schedule="constant",
        warmup_steps=2, weight_decay=0.1, clip_norm=1.0))
    whole = _train(root / "tx", _config(), tx=_user_tx())
    # Stopped by on_eval at step 3 (checkpointed), then the same call again.
    stop = {**_config(), "eval": {"every_steps": 3, "batch_size": B}}
    first = _train(root / "tx_resumed", stop, tx=_user_tx(), on_eval=lambda step, m: step == 3)
    again = _train(root / "tx_resumed", stop, tx=_user_tx())
    return {"by_name": by_name, "whole": whole, "first": first, "again": again, "root": root}


def test_an_optax_function_by_name_equals_the_hand_loop(runs):
    """optax.lion is not one of jtrain's names: the learning rate with its warmup, the
    weight decay with jtrain's mask (matrices only) and the clipping wrap it."""
    schedule = optax.join_schedules([optax.linear_schedule(0.0, LR, 2),
                                     optax.constant_schedule(LR)], [2])
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.lion(schedule, b1=0.9, b2=0.99, weight_decay=0.1,
                                mask={"w": True, "b": False}))
    assert runs["by_name"].summary["step"] == STEPS
    _assert_params(runs["by_name"].state.params, _hand_loop(tx))


def test_train_tx_equals_the_hand_loop_and_resumes_bitwise(runs):
    _assert_params(runs["whole"].state.params, _hand_loop(_user_tx()))
    assert runs["first"].stopped_by == "on_eval" and runs["first"].summary["step"] == 3
    assert runs["again"].summary["resumed_from"] == 3
    assert runs["again"].summary["state_sha256"] == runs["whole"].summary["state_sha256"]
    log = (runs["root"] / "tx" / "train.log").read_text()
    assert "jtrain: optimizer: the optax transformation given to jtrain.train(tx=...)" in log
    assert "jtrain: optimizer optax.lion, peak lr 0.01" in (
        runs["root"] / "name" / "train.log").read_text()


def test_a_tx_run_is_evaluated_with_its_tx_and_refused_without(runs):
    """config.json's optim.name (adamw) does not build a tx run's optimizer state:
    without the same tx, evaluation is one line naming tx; with it, the checkpoint
    restores and scores exactly as the run's own last eval."""
    from jtrain.errors import EvaluateError, render
    from jtrain.evaluate import evaluate_checkpoint

    workdir, d = str(runs["root"] / "tx_resumed"), _data()
    with pytest.raises(EvaluateError) as e:
        evaluate_checkpoint(workdir, model=_model(), loss_fn=_loss, data=d, plots=False)
    line = render(e.value)
    assert "\n" not in line and "optimizer passed from Python" in line and "tx=" in line
    report = evaluate_checkpoint(workdir, model=_model(), loss_fn=_loss, data=d,
                                 plots=False, tx=_user_tx())
    assert report["metrics"]["eval/loss"] == runs["again"].history[-1]["eval/loss"]


@pytest.mark.parametrize("optim_cfg, key", [
    ({"name": "optax.no_such_fn"}, "optim.name"),
    ({"name": "optax.contrib.no_such_fn"}, "optim.name"),
    ({"name": "optax.GradientTransformation"}, "optim.name"),  # a class, not a factory
    ({"name": "optax.tree.norm"}, "optim.name"),  # only attributes of optax / contrib
    ({"name": "optax.safe_norm"}, "optim.kwargs.x"),  # a function, not a factory
    ({"name": "optax.lion", "kwargs": {"beta1": 0.9}}, "optim.kwargs.beta1"),
    ({"name": "optax.lion", "kwargs": {"learning_rate": 0.1}}, "optim.kwargs.learning_rate"),
    ({"name": "optax.lion", "kwargs": {"b1": "high"}}, "optim.kwargs"),
    ({"name": "optax.adabelief", "weight_decay": 0.1}, "optim.weight_decay"),
    ({"name": "adamw", "kwargs": {"b1": 0.5}}, "optim.kwargs.b1"),  # adamw takes none
    ({"name": "lionn"}, "optim.name"),
])
def test_bad_names_and_arguments_are_one_line(optim_cfg, key):
    with pytest.raises(ConfigError) as e:
        jtrain.make_optimizer(optim_cfg, 10)
    assert e.value.key == key, str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("config, key", [
    (_config(name="sgd"), "optim.name"),
    (_config(lr=0.5), "optim.lr"),
    (_config(clip_norm=1.0), "optim.clip_norm"),
    ({**_config(), "population": {"size": 2}}, "population.size"),
])
def test_train_tx_refuses_keys_it_would_ignore(tmp_path, config, key):
    with pytest.raises(ConfigError) as e:
        _train(tmp_path / "r", config, tx=optax.sgd(0.1))
    assert e.value.key == key, str(e.value)
    assert not (tmp_path / "r" / "summary.json").exists()
