"""Memory planning: the bisection over accumulation counts, and a run over a synthetic
budget that trains with the planned count and ends with the unplanned run's params."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jtrain
from jtrain import config as config_lib

from jtrain.control import memory
from jtrain.errors import ConfigError


def test_plan_picks_the_smallest_count_that_fits_and_bisects():
    calls = []

    def measure(k):  # 1000 fixed + 6400 of activations split over k microbatches
        calls.append(k)
        return 1000 + 6400 // k

    p = memory.plan(measure, per_device_batch=64, configured=1, budget=2700, source="test")
    assert (p.accum, p.bytes) == (4, 2600)  # 1 -> 7400, 2 -> 4200, 4 -> 2600
    # 7 candidates: the configured one, the last, then bisection (3); none twice
    assert len(calls) == len(set(calls)) <= 5
    assert "planned grad_accum_steps=4 (microbatch 16 per device)" in p.describe()
    kept = memory.plan(measure, per_device_batch=64, configured=2, budget=5000,
                       source="test")
    assert (kept.accum, kept.configured) == (2, 2) and "kept" in kept.describe()
    # multiples of the configured count only
    assert memory.plan(measure, per_device_batch=12, configured=3, budget=2700,
                       source="test").accum == 6
    with pytest.raises(ConfigError, match="memory.budget_bytes.*microbatch 1"):
        memory.plan(measure, per_device_batch=64, configured=1, budget=1050, source="test")


def test_device_budget_sources():
    cpu = jax.devices()[0]
    assert memory.device_budget(0, cpu) == (None, "")
    assert memory.device_budget(-1, cpu) == (None, "")  # CPU reports no limit
    assert memory.device_budget(5e6, cpu) == (5_000_000, "memory.budget_bytes")
    with pytest.raises(ConfigError, match="memory.budget_bytes"):
        config_lib.resolve({"memory": {"budget_bytes": -0.5}})


class Wide(nn.Module):
    """Activations (2048 per row, kept several times for the backward pass) outweigh the
    params, as in the models that run out of memory."""

    @nn.compact
    def __call__(self, x, train=False):
        h = nn.Dense(2048)(x)
        for _ in range(3):
            h = nn.gelu(h) * jnp.tanh(h)
        return nn.Dense(3)(h)


def _data(n=1024):
    r = np.random.default_rng(0)
    x = r.normal(size=(n, 8)).astype(np.float32)
    return {"inputs": x, "targets": (x[:, 0] > 0).astype(np.int32)}


def _cfg(**memory_over):
    return {"total_steps": 4, "seed": 0,
            # SGD: the update is linear in the gradient, so the summation order of the
            # microbatches shows as float rounding only (Adam divides a near-zero
            # gradient by its own magnitude and can amplify that rounding to ~1e-5).
            "optim": {"name": "sgd", "lr": 0.05, "schedule": "constant",
                      "kwargs": {"momentum": 0.9}},
            "data": {"batch_size": 256, "shuffle": False},
            "eval": {"every_steps": 0}, "log": {"writers": ("jsonl",), "verbosity": 0},
            "checkpoint": {"every_steps": 0}, "memory": memory_over}


@pytest.mark.multidevice  # per device: 256 / 8 devices = 32 rows
def test_planned_run_matches_the_unplanned_one(tmp_path):
    data = _data()
    # What each count needs, compiled here one by one (per device: 256 / 8 devices = 32).
    counts = (1, 2, 4, 8, 16, 32)
    need = {}
    for k in counts:
        cfg = config_lib.resolve({**_cfg(), "optim": {**_cfg()["optim"],
                                                      "grad_accum_steps": k}})
        b = jtrain.build(cfg, sample=data["inputs"][0], model=Wide(),
                            eval_example={"inputs": data["inputs"][0],
                                          "targets": data["targets"][0]})
        batch = {key: jax.ShapeDtypeStruct((256,) + v.shape[1:], v.dtype)
                 for key, v in data.items()}
        need[k] = memory.step_bytes(b.train_step.lower(b.abstract, batch).compile())
    assert need[1] > need[32], need  # smaller microbatches need less
    budget = (need[1] + min(need.values())) // 2
    expected = min(k for k in counts if need[k] <= budget)
    assert expected > 1

    planned = jtrain.train(_cfg(budget_bytes=budget), str(tmp_path / "planned"),
                           model=Wide(), train_data=data)
    plain = jtrain.train(_cfg(), str(tmp_path / "plain"), model=Wide(), train_data=data)
    header = (tmp_path / "planned" / "train.log").read_text()
    assert f"planned grad_accum_steps={expected} (microbatch {32 // expected} per device)" \
        in header
    for a, b in zip(jax.tree.leaves(planned.state.params), jax.tree.leaves(plain.state.params),
                    strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
