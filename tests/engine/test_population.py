"""A population (population.size > 1): member i of a vmapped population equals the
single run with member i's seed, learning rate and weight decay (same batches; Linen with
dropout, and NNX); a run writes each member's metrics as `<name>/m<i>`, summary.json's
population block and population.png; `export --member` writes that member as a plain
run's export; the section's rules are one config error each."""

import json
import os

import flax.linen as nn
import jax
import numpy as np
import pytest

import jtrain
from jtrain.engine import checkpoint_eval as evaluate_lib
from jtrain.engine import population as population_lib
from jtrain.checkpoint import export as export_lib
from jtrain.errors import ConfigError, UsageError
from projects.mymodels import Net as Net3


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        h = nn.Dropout(0.2, deterministic=not train)(nn.relu(nn.Dense(16, name="body")(x)))
        return nn.Dense(3, name="head")(h)


class NnxNet(Net3):  # the user project's NNX classifier: 4 -> 8 -> 3 classes
    def __init__(self, rngs):
        super().__init__(8, rngs, classes=3)


def _data(n=64):
    r = np.random.default_rng(0)
    x = r.normal(size=(n, 4)).astype(np.float32)
    return {"inputs": x, "targets": ((x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0))}


def _cfg(**over):
    return {"total_steps": 4, "seed": 0, "data": {"batch_size": 8, "shuffle": False},
            "eval": {"every_steps": 0}, "log": {"verbosity": 0, "writers": ("jsonl",)},
            "optim": {"name": "adamw", "lr": 0.01, "schedule": "warmup_cosine",
                      "warmup_steps": 1}, **over}


def _build(cfg, model):
    data = _data()
    return jtrain.build(jtrain.resolve(cfg), sample=data["inputs"][0], model=model,
                        eval_example={k: v[0] for k, v in data.items()})


def _train(b, steps=4):
    data, state = _data(), b.init()
    for i in range(steps):
        state, metrics = b.train_step(state, {k: v[8 * i: 8 * i + 8] for k, v in data.items()})
    return state, metrics


@pytest.mark.parametrize("model, member", [(Net(), 1), (NnxNet, 0)],
                         ids=["linen_dropout", "nnx"])
def test_member_i_equals_the_single_run_with_its_seed_lr_and_weight_decay(model, member):
    seeds, lrs, wds = (3, 4), (0.02, 0.03), (0.05, 0.2)
    pop = _build(_cfg(population={"size": 2, "seeds": list(seeds), "vary": {
        "optim.lr": list(lrs), "optim.weight_decay": list(wds)}}), model)
    state, metrics = _train(pop)
    assert int(state.step) == 4 and state.skipped_steps.shape == (2,)
    seed, lr, wd = seeds[member], lrs[member], wds[member]
    single, single_metrics = _train(_build(_cfg(seed=seed, optim={
        **_cfg()["optim"], "lr": lr, "weight_decay": wd}), model))
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(single.params), strict=True):
        np.testing.assert_allclose(np.asarray(a)[member], np.asarray(b), atol=1e-6, rtol=0)
    for name in ("train/loss", "train/lr", "train/grad_norm"):
        np.testing.assert_allclose(float(metrics[f"{name}/m{member}"]),
                                   float(single_metrics[name]), rtol=1e-5)
    assert float(metrics["train/loss"]) == pytest.approx(
        np.mean([float(metrics[f"train/loss/m{i}"]) for i in range(2)]))
    # the other member differs: its own seed, lr and weight decay were applied
    other = jax.tree.leaves(state.params)[0]
    assert not np.allclose(np.asarray(other)[0], np.asarray(other)[1])


@pytest.mark.slow  # seconds of CPU: the full suite runs it (tests/README.md)
def test_a_population_run_writes_member_metrics_summary_and_exports_a_member(tmp_path):
    data = _data()
    work = str(tmp_path / "run")
    cfg = _cfg(population={"size": 2, "vary": {"optim": {"lr": [0.01, 0.05]}}},
               eval={"every_steps": 4}, log={"verbosity": 0, "writers": ("jsonl",),
                                             "every_steps": 2})
    result = jtrain.train(cfg, work, model=Net(), train_data=data, eval_data=data)
    records = [json.loads(line) for line in open(os.path.join(work, "metrics.jsonl"))]
    train = next(r for r in records if "train/loss" in r)
    assert {"train/loss/m0", "train/loss/m1", "train/lr/m1"} <= set(train)
    assert train["train/lr/m1"] == pytest.approx(5 * train["train/lr/m0"], rel=1e-5)
    final = result.summary
    assert final["eval/loss"] == pytest.approx((final["eval/loss/m0"] + final["eval/loss/m1"]) / 2)
    pop = final["population"]
    assert pop["size"] == 2 and pop["seeds"] == [0, 1] and pop["lrs"] == [0.01, 0.05]
    losses = [final["eval/loss/m0"], final["eval/loss/m1"]]
    assert pop["best_member"] == int(np.argmin(losses))
    assert pop["metrics"]["eval/loss"]["std"] == pytest.approx(np.std(losses))
    assert (tmp_path / "run" / "population.png").stat().st_size > 0
    assert population_lib.winners(records, 2)["eval/loss"] == pop["best_member"]

    out = str(tmp_path / "m1")
    record = export_lib.export(work, out, member=1)
    assert record["member"] == 1 and record["config"]["population"]["size"] == 1
    assert record["config"]["seed"] == 1 and record["config"]["optim"]["lr"] == 0.05
    exported = export_lib.load_export(out)
    params = {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(x)[1]
              for p, x in jax.tree_util.tree_flatten_with_path(result.state.params)[0]}
    exported = {k.removeprefix("params/"): v for k, v in exported.items()}
    params = {k.removeprefix("params/"): v for k, v in params.items()}
    assert set(exported) == set(params) and len(params) == 4
    for name, arr in exported.items():
        np.testing.assert_array_equal(arr, params[name])
    with pytest.raises(UsageError, match="--member=0..1"):
        export_lib.export(work, str(tmp_path / "x"))
    with pytest.raises(UsageError, match="members 0..1"):
        export_lib.export(work, str(tmp_path / "x"), member=2)
    with pytest.raises(UsageError, match="--member=i"):  # the whole population
        evaluate_lib.evaluate_checkpoint(work, model=Net())


@pytest.mark.parametrize("over, key", [
    ({"population": {"size": 2, "vary": {"optim.b1": [0.9, 0.8]}}}, "population.vary.optim.b1"),
    ({"population": {"size": 2, "vary": {"optim.lr": [0.1]}}}, "population.vary.optim.lr"),
    ({"population": {"size": 2, "seeds": [3]}}, "population.seeds"),
    ({"population": {"size": 2, "vary": {"optim.weight_decay": [0.1, -1.0]}}},
     "population.vary.optim.weight_decay"),
    ({"optim": {"name": "adafactor"}, "population": {
        "size": 2, "vary": {"optim.weight_decay": [0.1, 0.2]}}},
     "population.vary.optim.weight_decay"),
    ({"population": {"size": 2, "seeds": [3, 3]}}, "population.seeds"),
    ({"population": {"size": 2}, "early_stop": {"monitor": "eval/loss"}},
     "early_stop.monitor"),
    ({"population": {"size": 2}, "plateau": {"monitor": "eval/loss"}}, "plateau.monitor"),
    ({"population": {"size": 2}, "spike": {"zscore": 3.0}}, "spike.zscore"),
])
def test_population_rules_are_one_config_error_each(over, key):
    with pytest.raises(ConfigError) as e:
        jtrain.resolve({**_cfg(), **over})
    assert e.value.key == key


def test_size_one_is_the_plain_run():
    b = _build(_cfg(), Net())
    assert b.population is None and b.state_abstract is b.abstract
    assert int(jax.device_get(b.init().step)) == 0


def test_winners_take_the_best_last_value_per_metric():
    records = [{"step": 2, "train/loss/m0": 1.0, "train/loss/m1": 2.0, "train/lr/m0": 0.1,
                "train/lr/m1": 0.3},
               {"step": 4, "train/loss/m0": 3.0, "train/loss/m1": 0.5,
                "eval/accuracy/m0": 0.9, "eval/accuracy/m1": 0.7, "eval/f1/0/m1": 0.2}]
    assert population_lib.winners(records, 2) == {"train/loss": 1, "eval/accuracy": 0}


@pytest.mark.multidevice
def test_on_8_devices_sharded_and_replicated_members_match_one_device(monkeypatch):
    """K=4 over mesh.data=4 (the member axis sharded) and K=3 (replicated) give each
    member the losses it has on one device (K=3's members are K=4's first three: same
    seeds, lrs and batches)."""
    from jtrain import mesh as mesh_lib

    lrs, data = [0.01, 0.02, 0.04, 0.08], _data()

    def losses(size, mesh):
        b = _build(_cfg(mesh=mesh, population={"size": size,
                                               "vary": {"optim.lr": lrs[:size]}}), Net())
        state, out = b.init(), []
        for i in range(2):
            state, m = b.train_step(state, {k: v[8 * i: 8 * i + 8] for k, v in data.items()})
            out.append([float(m[f"train/loss/m{j}"]) for j in range(size)])
        return b, state, np.asarray(out)

    sharded, s4, l4 = losses(4, {"data": 4, "tensor": 2})
    replicated, s3, l3 = losses(3, {"data": 4, "tensor": 2})
    assert sharded.population.sharded and not replicated.population.sharded
    for leaf in jax.tree.leaves(s4.params):
        assert leaf.sharding.spec[0] == "data" and len(leaf.sharding.device_set) == 8
    for leaf in jax.tree.leaves(s3.params):
        assert leaf.sharding.spec[0] is None
    make = mesh_lib.make_mesh
    monkeypatch.setattr(mesh_lib, "make_mesh",
                        lambda cfg, devices=None: make(cfg, devices=jax.devices()[:1]))
    _, s1, l1 = losses(4, {"data": 1})
    assert len(jax.tree.leaves(s1.params)[0].sharding.device_set) == 1
    np.testing.assert_allclose(l4, l1, rtol=1e-5)
    np.testing.assert_allclose(l3, l1[:, :3], rtol=1e-5)


def test_each_members_metrics_and_evals_carry_its_own_index():
    """Member i's values under /m<i>, in the train step's reduction and in the eval of
    every member (a member's eval is of its own slice of the state)."""
    from types import SimpleNamespace

    from jtrain.engine.evaluation import Evaluation

    stacked = {"train/loss": jax.numpy.asarray([1.0, 2.0, 4.0]),
               "train/status": jax.numpy.asarray([0, 2, 0], jax.numpy.int32)}
    out = population_lib.reduce_metrics(stacked, 3)
    assert [float(out[f"train/loss/m{i}"]) for i in range(3)] == [1.0, 2.0, 4.0]
    assert float(out["train/loss"]) == pytest.approx(7 / 3) and int(out["train/status"]) == 2
    state = make_state_for_members([10.0, 20.0, 30.0])
    pop = SimpleNamespace(size=3)
    result = population_lib.per_member(
        pop, state, lambda s: Evaluation({"eval/loss": float(s.params["w"]),
                                          "eval/name": "x"}, {}, 1))
    assert [result.scalars[f"eval/loss/m{i}"] for i in range(3)] == [10.0, 20.0, 30.0]
    assert result.scalars["eval/loss"] == 20.0 and result.scalars["eval/name"] == "x"


def make_state_for_members(values):
    from jtrain.state import TrainState

    k = len(values)
    z = jax.numpy.zeros(k, jax.numpy.int32)
    return TrainState(step=jax.numpy.int32(5), params={"w": jax.numpy.asarray(values)},
                      opt_state={}, rng=jax.numpy.zeros((k, 2), jax.numpy.uint32),
                      loss_scale={}, skipped_steps=z, consecutive_skips=z, halted_at=z,
                      lr_factor=jax.numpy.ones(k))
