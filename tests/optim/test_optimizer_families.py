"""muon, schedule_free_adamw / _sgd and prodigy: jtrain's step equals optax's own
optimizer on the same batches, and combines with clipping, freezing, accumulation, the
plateau factor and lr_mults; schedule-free evaluation params; bad combinations."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jtrain
from jtrain import losses, optim
from jtrain import step as step_lib
from jtrain.state import TrainState

LR = 0.05


def _apply(params, inputs, rng=None, train=False):
    return inputs @ params["w"] + params["b"]  # [B, T, V]: a 2-D and a 1-D leaf


def _batches(n=3, b=8, t=5, d=4, v=7):
    r = np.random.default_rng(0)
    return [{"inputs": r.normal(size=(b, t, d)).astype(np.float32),
             "targets": r.integers(0, v, (b, t)).astype(np.int32)} for _ in range(n)]


def _params():
    r = np.random.default_rng(1)
    return {"w": jnp.asarray(r.normal(size=(4, 7)), jnp.float32),
            "b": jnp.asarray(r.normal(size=(7,)), jnp.float32)}


def _state(params, tx, lr_factor=1.0):
    return TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params),
                      rng=jax.random.key_data(jax.random.key(0)),
                      loss_scale={"scale": jnp.float32(1), "good_steps": jnp.int32(0)},
                      skipped_steps=jnp.int32(0), consecutive_skips=jnp.int32(0),
                      halted_at=jnp.int32(0), lr_factor=jnp.float32(lr_factor))


def _loss(params, batch):
    (loss_sum, weight), _ = losses.split_loss(losses.default_loss(_apply(params, batch["inputs"]),
                                                                  batch))
    return loss_sum / weight


def _jtrain_run(optim_cfg, *, accum=1, lr_factor=1.0, steps=3):
    tx, schedule = jtrain.make_optimizer(optim_cfg, 10)
    train_step = jax.jit(step_lib.make_train_step(_apply, losses.default_loss, tx, schedule,
                                                  grad_accum_steps=accum))
    state = _state(_params(), tx, lr_factor)
    for batch in _batches(steps):
        state, _ = train_step(state, batch)
    return state


def _optax_run(tx, steps=3):
    params = _params()
    opt_state = tx.init(params)
    for batch in _batches(steps):
        grads = jax.grad(_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params, opt_state


REFERENCES = {  # jtrain's optim section -> the same optimizer written with optax
    "muon": ({"name": "muon", "lr": LR, "schedule": "constant"},
             lambda lr: optax.contrib.muon(lr, ns_steps=5, beta=0.95, adam_b1=0.9,
                                           adam_b2=0.999)),
    "schedule_free_adamw": ({"name": "schedule_free_adamw", "lr": LR, "schedule": "constant",
                             "warmup_steps": 2},
                            lambda lr: optax.contrib.schedule_free_adamw(lr, warmup_steps=2)),
    "schedule_free_sgd": ({"name": "schedule_free_sgd", "lr": LR, "schedule": "constant",
                           "warmup_steps": 2},
                          lambda lr: optax.contrib.schedule_free_sgd(lr, warmup_steps=2)),
    "prodigy": ({"name": "prodigy", "lr": 1.0, "schedule": "constant"},
                lambda lr: optax.contrib.prodigy(lr / LR)),
}


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", list(REFERENCES))
def test_step_equals_optax_with_clipping_and_accumulation(name):
    cfg, reference = REFERENCES[name]
    state = _jtrain_run({**cfg, "clip_norm": 0.5}, accum=2)
    params, _ = _optax_run(optax.chain(optax.clip_by_global_norm(0.5), reference(LR)))
    _close(state.params, params)
    assert not np.allclose(np.asarray(state.params["w"]), np.asarray(_params()["w"]))


@pytest.mark.parametrize("name", list(REFERENCES))
def test_frozen_leaves_never_move_and_have_no_state(name):
    cfg, _ = REFERENCES[name]
    state = _jtrain_run({**cfg, "frozen": ["^b$"], "weight_decay": 0.1})
    assert np.array_equal(np.asarray(state.params["b"]), np.asarray(_params()["b"]))
    assert not np.array_equal(np.asarray(state.params["w"]), np.asarray(_params()["w"]))
    shapes = {tuple(x.shape) for x in jax.tree.leaves(state.opt_state)}
    assert (7,) not in shapes, shapes  # nothing of b's shape: no state for it


@pytest.mark.parametrize("name", ["schedule_free_adamw", "schedule_free_sgd"])
def test_plateau_factor_and_lr_mults_scale_the_schedule_free_base_step(name):
    cfg, reference = REFERENCES[name]
    # A constant factor f from the start is schedule-free with lr * f: the average's
    # weights are ratios of learning rates, so only the base step changes.
    halved = _jtrain_run(cfg, lr_factor=0.5)
    _close(halved.params, _optax_run(reference(LR * 0.5))[0])
    mult = _jtrain_run({**cfg, "lr_mults": {"^[wb]$": 0.5}})
    _close(mult.params, halved.params)


def test_schedule_free_eval_params_are_optax_s():
    cfg, reference = REFERENCES["schedule_free_adamw"]
    state = _jtrain_run({**cfg, "clip_norm": 1.0})
    sf = state.opt_state[1]  # chain(clip, schedule_free)
    assert isinstance(sf, optax.contrib.ScheduleFreeState)
    _close(optim.schedule_free_eval_params(state.opt_state, state.params),
           optax.contrib.schedule_free_eval_params(sf, state.params))
    assert optim.schedule_free_eval_params(
        _jtrain_run(REFERENCES["muon"][0]).opt_state, _params()) is None


def test_schedule_free_eval_params_keep_frozen_leaves():
    state = _jtrain_run({**REFERENCES["schedule_free_sgd"][0], "frozen": ["^b$"]})
    evaluated = optim.schedule_free_eval_params(state.opt_state, state.params)
    assert np.array_equal(np.asarray(evaluated["b"]), np.asarray(_params()["b"]))
    assert not np.allclose(np.asarray(evaluated["w"]), np.asarray(state.params["w"]))


def test_prodigy_weight_decay_is_prodigy_s_own_on_decayed_leaves():
    # Only "w" is decayed by jtrain's mask; optax's prodigy decays every leaf, so compare
    # on a model without the bias.
    cfg = {"name": "prodigy", "lr": 1.0, "schedule": "constant", "weight_decay": 0.1}
    tx, _ = jtrain.make_optimizer(cfg, 10)
    ref = optax.contrib.prodigy(1.0, weight_decay=0.1)
    params = {"w": _params()["w"]}
    grads = {"w": jnp.full((4, 7), 0.3)}
    s1, s2 = tx.init(params), ref.init(params)
    p1 = p2 = params
    for _ in range(3):
        u1, s1 = tx.update(grads, s1, p1)
        u2, s2 = ref.update(grads, s2, p2)
        p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
    _close(p1, p2)


def test_muon_decays_its_fallback_leaves_by_the_mask():
    tx, _ = jtrain.make_optimizer({"name": "muon", "lr": 0.5, "schedule": "constant",
                                   "weight_decay": 0.1}, 10)
    params = {"conv": jnp.ones((2, 2, 3)), "bias": jnp.ones((3,))}  # both adam's
    zeros = jax.tree.map(jnp.zeros_like, params)
    new = optax.apply_updates(params, tx.update(zeros, tx.init(params), params)[0])
    np.testing.assert_allclose(new["conv"], 0.95 * np.ones((2, 2, 3)), rtol=1e-6)
    assert np.array_equal(np.asarray(new["bias"]), np.ones(3))  # ndim < 2: never decayed


@pytest.mark.parametrize("overrides, message", [
    ({"name": "schedule_free_adamw"},
     r"^optim\.schedule: schedule_free_adamw takes a constant learning rate .*'warmup_cosine'"),
    ({"name": "schedule_free_sgd", "schedule": "cosine"},
     r"^optim\.schedule: schedule_free_sgd takes a constant"),
    ({"name": "schedule_free_adamw", "schedule": "constant", "b1": 0.0},
     r"^optim\.b1: must be > 0 for schedule_free_adamw"),
    ({"name": "muon", "kwargs": {"beta": 1.0}}, r"^optim\.kwargs\.beta: must be < 1"),
    ({"name": "prodigy", "b2": 1.0}, r"^optim\.b2: must be < 1 for prodigy"),
    ({"name": "muon", "kwargs": {"ns_steps": 0}}, r"^optim\.kwargs\.ns_steps: must be >= 1"),
    ({"name": "prodigy", "kwargs": {"estim_lr0": 0.0}}, r"^optim\.kwargs\.estim_lr0: "),
    ({"name": "sgd", "kwargs": {"beta": 0.9}},
     r"^optim\.kwargs\.beta: sgd takes no argument 'beta'; it takes: momentum, nesterov"),
    ({"name": "muon", "muon_beta": 0.9},
     r"^optim\.muon_beta: renamed to optim\.kwargs\.beta \(with optim\.name='muon'\)$"),
    ({"name": "optax.contrib.schedule_free_adamw"},
     r"^optim\.name: optax\.contrib\.schedule_free_adamw by name is not supported .*"
     r"use optim\.name='schedule_free_adamw' or 'schedule_free_sgd'"),
    ({"name": "optax.contrib.schedule_free"}, r"^optim\.name: optax\.contrib\.schedule_free "),
])
def test_bad_combinations_are_one_line_config_errors(overrides, message):
    with pytest.raises(jtrain.ConfigError, match=message) as info:
        jtrain.make_optimizer(overrides, 10)
    assert "\n" not in str(info.value)
