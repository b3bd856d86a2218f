"""A model's state beyond parameters is carried, whatever holds it: NNX BatchStat
variables and a user's own variable kind, Linen collections; found by type when the model
is split (an instance, its class or a function building it), constant and RNG state left
as they are. The numbers (statistics against numpy, eval by hand) are in
tests/engine/test_model_state.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn, nnx

import jtrain
from jtrain.models import adapters

class NnxNorm(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.head = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.head(self.norm(self.dense(x)))


class LinenNorm(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(1)(nn.BatchNorm(use_running_average=not train)(nn.Dense(8)(x)))


class Seen(nnx.Variable):
    """A user's own state kind: a count of the examples seen."""


class Counting(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 1, rngs=rngs)
        self.seen = Seen(jnp.zeros(()))

    def __call__(self, x):
        self.seen[...] = self.seen[...] + x.shape[0]
        return self.dense(x)


class Scaled(nnx.Module):
    """Constant (never changed) state and dropout's RNG state: carried as they are."""

    def __init__(self, rngs):
        self.scale = nnx.Variable(jnp.full((4,), 2.0))
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.dense = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x):
        return self.dense(self.drop(x * self.scale[...]))


def _data():
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(64, 4)) * 3 + 5).astype(np.float32)  # far from mean 0, var 1
    return {"inputs": x, "targets": x[:, :1].copy()}


CONFIG = {"total_steps": 2, "data": {"batch_size": 8, "val_fraction": 0.0},
          "log": {"verbosity": 0}, "checkpoint": {"every_steps": 0}}


@pytest.mark.parametrize("make, names", [
    (lambda: NnxNorm(nnx.Rngs(0)), ["norm/mean", "norm/var"]),
    (lambda: NnxNorm, ["norm/mean", "norm/var"]),
    (lambda: LinenNorm(), ["batch_stats/BatchNorm_0/mean", "batch_stats/BatchNorm_0/var"]),
    (lambda: Counting(nnx.Rngs(0)), ["seen"]),
], ids=["nnx_instance", "nnx_class", "linen", "nnx_counter"])
def test_the_state_a_forward_pass_changes_is_carried(tmp_path, make, names):
    result = jtrain.train(CONFIG, tmp_path / "run", model=make(), train_data=_data())
    flat = {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(result.state.model_state)[0]}
    assert sorted(flat) == names
    if names == ["seen"]:
        assert flat["seen"] == 2 * 8  # two steps of 8 examples: the count moved each step
    else:
        assert (flat[names[0]] != 0).all()  # the running mean left its initial zeros


def test_state_is_found_by_type_before_anything_is_traced():
    """An NNX BatchNorm is found when the model is split (to_model_fns), whatever builds
    it: an instance, its class, or a function rngs -> model."""
    for model in (NnxNorm(nnx.Rngs(0)), NnxNorm, lambda rngs: NnxNorm(rngs)):
        carried = adapters.to_model_fns(model).nnx_graph.carried
        assert sorted("/".join(map(str, p)) for p, _ in nnx.to_flat_state(carried)) == [
            "norm/mean", "norm/var"]


@pytest.mark.slow  # seconds of CPU: the full suite runs it (tests/README.md)
def test_constant_and_rng_state_are_carried_as_they_are(tmp_path):
    result = jtrain.train(CONFIG, tmp_path / "run", model=Scaled(nnx.Rngs(0)),
                          train_data=_data())
    assert result.summary["step"] == 2 and result.stopped_by is None
    np.testing.assert_array_equal(result.state.model_state["scale"], np.full((4,), 2.0))


def test_a_model_without_state_keeps_the_state_tree_it_had(tmp_path):
    """No `model_state` leaf: checkpoints and state hashes of such runs are unchanged."""
    model = nn.Dense(1)
    result = jtrain.train(CONFIG, tmp_path / "run", model=model, train_data=_data())
    assert result.state.model_state is None
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(result.state)[0]]
    assert not any("model_state" in p for p in paths)
