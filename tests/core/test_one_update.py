"""The update from summed gradients exists once (`update_from_sums`): the plain step,
accumulation and determinism.topology_invariant all call it, and it equals a hand
computation (normalisation by the weight sum and the loss scale, the optax update, the
weight EMA, the metrics)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jtrain import losses
from jtrain import mesh as mesh_lib
from jtrain import step as step_lib
from jtrain.state import ema_rate_fn
from test_step import _linear_apply, _masked_lm_batch, _state

LR = 0.5


def _params():
    r = np.random.default_rng(1)
    return {"w": jnp.asarray(r.normal(size=(4, 7)), jnp.float32), "b": jnp.zeros(7)}


def _steps(k=1, chunks=1):
    """(the built-in step jitted, the topology-invariant step on one device)."""
    tx = optax.sgd(LR)
    make = lambda **kw: step_lib.make_train_step(  # noqa: E731
        _linear_apply, losses.default_loss, tx, lambda s: LR, grad_accum_steps=k, **kw)
    mesh = mesh_lib.make_mesh(None, devices=jax.devices()[:1])
    plain = jax.jit(make())
    split = make(invariant=(mesh, chunks, mesh_lib.replicated(mesh)))
    return tx, mesh, plain, split


def _run(step, tx, mesh, batch, device=False):
    state = _state(_params(), tx)
    if device:
        batch = mesh_lib.host_to_device(batch, mesh)
    new, metrics = step(state, batch)
    return jax.device_get(new.params), jax.device_get(metrics)


@pytest.mark.parametrize("k,chunks", [(1, 1), (2, 4)])
def test_invariant_path_equals_the_built_in_update(k, chunks):
    batch = _masked_lm_batch(0, b=8)
    tx, mesh, plain, split = _steps(k, chunks)
    p1, m1 = _run(plain, tx, mesh, batch)
    p2, m2 = _run(split, tx, mesh, batch, device=True)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
        if chunks == 1:  # one device, one chunk: the same arithmetic, the same bits
            np.testing.assert_array_equal(a, b)
        else:  # chunk sums in another order: float rounding
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for name in ("train/loss", "train/grad_norm", "train/tokens", "train/lr"):
        np.testing.assert_allclose(m1[name], m2[name], rtol=1e-6, err_msg=name)


@pytest.mark.slow  # seconds of CPU: the full suite runs it (tests/README.md)
def test_every_path_calls_the_one_update(monkeypatch):
    """A constant added inside `update_from_sums` moves the plain, the accumulated and
    the topology-invariant step's params by exactly that constant."""
    batch = _masked_lm_batch(0, b=8)
    paths = {"plain": (1, 1), "accumulated": (2, 1), "invariant": (1, 2)}
    before = {}
    for name, (k, chunks) in paths.items():
        tx, mesh, plain, split = _steps(k, chunks)
        step = split if name == "invariant" else plain
        before[name] = _run(step, tx, mesh, batch, device=name == "invariant")[0]
    shared = step_lib.update_from_sums

    def planted(*args, **kwargs):
        applied, metrics = shared(*args, **kwargs)
        return (lambda: applied()._replace(params=jax.tree.map(
            lambda p: p + 1.0, applied().params))), metrics

    monkeypatch.setattr(step_lib, "update_from_sums", planted)
    for name, (k, chunks) in paths.items():
        tx, mesh, plain, split = _steps(k, chunks)
        step = split if name == "invariant" else plain
        after = _run(step, tx, mesh, batch, device=name == "invariant")[0]
        for a, b in zip(jax.tree.leaves(before[name]), jax.tree.leaves(after), strict=True):
            np.testing.assert_array_equal(b, a + np.float32(1.0), err_msg=name)


def test_update_from_sums_equals_a_hand_computation():
    """SGD with momentum, fp16's loss scale 8, an EMA with decay 0.9, a named term and
    train metric states passed through: against numpy."""
    r = np.random.default_rng(2)
    params = {"w": r.normal(size=(3, 2)).astype(np.float32)}
    ema = {"w": r.normal(size=(3, 2)).astype(np.float32)}
    grads = {"w": r.normal(size=(3, 2)).astype(np.float32)}
    loss_sum, weight, scale, lr, factor = 6.0, 3.0, 8.0, 0.1, 0.5
    tx = optax.sgd(lr, momentum=0.9)
    opt = tx.init(params)
    context = step_lib.Context(step=jnp.int32(4), lr_factor=jnp.float32(factor),
                               loss_scale=jnp.float32(scale))
    inner = step_lib.Updated(params, opt, ema, "model state")
    sums = (jnp.float32(loss_sum), jnp.float32(weight),
            {"aux": (jnp.float32(1.5), jnp.float32(0.5))}, "states")
    applied, metrics = step_lib.update_from_sums(
        tx, lambda s: lr * (s + 1), inner, sums, grads, context, ema_rate_fn(0.9))
    new = applied()
    g = grads["w"].astype(np.float64) / (weight * scale)
    want = params["w"] - lr * factor * g  # momentum's first step: the gradient itself
    np.testing.assert_allclose(new.params["w"], want, rtol=1e-6)
    np.testing.assert_allclose(new.ema["w"], ema["w"] + 0.1 * (want - ema["w"]), rtol=1e-5)
    assert new.model_state == "model state"
    np.testing.assert_allclose(metrics["loss"], loss_sum / weight, rtol=1e-7)
    np.testing.assert_allclose(metrics["grad_norm"], np.linalg.norm(g), rtol=1e-6)
    np.testing.assert_allclose(metrics["lr"], lr * 5 * factor, rtol=1e-6)
    np.testing.assert_allclose(metrics["aux"], 3.0)
    assert metrics["tokens"] == weight and metrics[step_lib.TRAIN_METRICS] == "states"


def test_a_step_of_your_own_keeps_the_engine_update():
    """The middle ground of docs/guide/own-step.md: its own loss computation, the
    engine's update: the same bits as the built-in step on the same batch."""
    batch = _masked_lm_batch(0, b=8)
    tx, mesh, plain, _ = _steps()

    def my_loss(params, batch, rng, scale):
        loss_sum, weight = losses.default_loss(_linear_apply(params, batch["inputs"]), batch)
        return loss_sum * scale, (loss_sum, weight)

    def update(state, batch, rng, context):
        (_, (loss_sum, weight)), grads = jax.value_and_grad(my_loss, has_aux=True)(
            state["params"], batch, rng, context.loss_scale)
        applied, metrics = step_lib.update_from_sums(
            tx, lambda s: LR, step_lib.Updated(state["params"], state["opt"], None, None),
            (loss_sum, weight, {}, None), grads, context)
        def new():  # run by the guard only when the update is kept
            params, opt, _, _ = applied()
            return {"params": params, "opt": opt}
        return new, metrics

    own = jax.jit(step_lib.make_step_train(step_lib.Step(init=None, update=update)))
    mine = _state({"params": _params(), "opt": tx.init(_params())}, tx)
    new, metrics = own(mine, batch)
    want, want_metrics = _run(plain, tx, mesh, batch)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(new.params["params"]), strict=True):
        np.testing.assert_array_equal(a, b)
    assert metrics["train/loss"] == want_metrics["train/loss"]
