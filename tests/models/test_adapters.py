"""Models whose state the train step would drop are refused before the first step: the
step carries parameters only, so BatchNorm's running statistics (NNX `nnx.BatchStat`,
Linen's `batch_stats`) or any variable a forward pass changes would be reset after every
step and evaluation would use their initial values. One ModelError line names the model,
the variables and the fix; models with constant state or RNG state still train."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn, nnx

import jtrain
from jtrain import errors
from jtrain.models import adapters

STATS_FIX = ("running statistics are not carried by the train step yet; use "
             "LayerNorm/RMSNorm or GroupNorm, or write the model without BatchNorm")


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


@pytest.mark.parametrize("make, line", [
    (lambda: NnxNorm(nnx.Rngs(0)), "NnxNorm: nnx.BatchStat variables norm.mean, norm.var "
                                   f"(BatchNorm): {STATS_FIX}"),
    (lambda: NnxNorm, f"NnxNorm: nnx.BatchStat variables norm.mean, norm.var (BatchNorm): "
                      f"{STATS_FIX}"),
    (lambda: LinenNorm(), f"LinenNorm: Linen variable collection 'batch_stats' (BatchNorm): "
                          f"{STATS_FIX}"),
    (lambda: Counting(nnx.Rngs(0)), "Counting: variable seen (Seen) changed by a forward "
                                    "pass in train mode: state other than parameters is not "
                                    "carried by the train step yet"),
], ids=["nnx_instance", "nnx_class", "linen", "nnx_counter"])
def test_train_refuses_state_it_would_drop(tmp_path, make, line):
    with pytest.raises(errors.ModelError) as caught:
        jtrain.train(CONFIG, tmp_path / "run", model=make(), train_data=_data())
    rendered = errors.render(caught.value)
    assert rendered.startswith(f"jtrain: model error: {line}"), rendered
    assert errors.exit_code(caught.value) == 2 and "\n" not in rendered
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before any step
    assert not list((tmp_path / "run").glob("checkpoints/*"))


def test_batch_stats_refused_by_type_before_anything_is_traced():
    """An NNX BatchNorm is found when the model is split (to_model_fns), whatever builds
    it: an instance, its class, or a function rngs -> model."""
    for model in (NnxNorm(nnx.Rngs(0)), NnxNorm, lambda rngs: NnxNorm(rngs)):
        with pytest.raises(errors.ModelError, match="nnx.BatchStat variables norm.mean"):
            adapters.to_model_fns(model)


def test_constant_and_rng_state_are_carried():
    fns = adapters.to_model_fns(Scaled(nnx.Rngs(0)))
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                          fns.existing_params)
    adapters.check_state_carried(fns, params, jax.ShapeDtypeStruct((8, 4), jnp.float32))


def test_a_model_that_cannot_be_called_is_left_to_the_pre_flight_checks():
    fns = adapters.to_model_fns(Counting(nnx.Rngs(0)))
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                          fns.existing_params)  # 5 features where the model takes 4
    adapters.check_state_carried(fns, params, jax.ShapeDtypeStruct((8, 5), jnp.float32))


def test_a_model_with_constant_state_trains(tmp_path):
    result = jtrain.train(CONFIG, tmp_path / "run", model=Scaled(nnx.Rngs(0)),
                          train_data=_data())
    assert result.summary["step"] == 2 and result.stopped_by is None
