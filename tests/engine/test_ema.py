"""The weight EMA (optim.ema): it equals the numpy recurrence over the params the step
produced, a skipped update leaves it untouched, frozen leaves keep an average equal to
themselves; eval.weights=both writes eval/... and eval/ema/... and a monitor may name
either; init.path starts it at the loaded params (an export) or takes the
source's average (a checkpoint); bad settings are one config error each."""

import json
import os

import flax.linen as nn
import jax
import numpy as np
import pytest

import jtrain
from jtrain import state as state_lib
from jtrain.checkpoint import export as export_lib
from jtrain.checkpoint import init_from as init_from_lib
from jtrain.errors import ConfigError


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        h = nn.relu(nn.Dense(16, name="body")(x))
        return nn.Dense(3, name="head")(h)


def _data(n=64, seed=0):
    r = np.random.default_rng(seed)
    x = r.normal(size=(n, 4)).astype(np.float32)
    return {"inputs": x, "targets": ((x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0))}


def _cfg(total_steps=6, ema=None, eval_cfg=None, checkpoint=None, **optim):
    return {"total_steps": total_steps, "seed": 0, "data": {"batch_size": 8},
            "checkpoint": checkpoint or {},
            "eval": {"every_steps": 0, **(eval_cfg or {})},
            "log": {"verbosity": 0, "writers": ("jsonl",)},
            "optim": {"name": "adamw", "lr": 0.05, "schedule": "constant",
                      "ema": ema or {}, **optim}}


def _build(cfg):
    data = _data()
    return jtrain.build(jtrain.resolve(cfg), sample=data["inputs"][0], model=Net(),
                        eval_example={"inputs": data["inputs"][0],
                                      "targets": data["targets"][0]})


def _leaves(tree):
    return {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_ema_is_the_numpy_recurrence_over_the_params_and_skips_with_the_update():
    b = _build(_cfg(ema={"decay": 0.9, "warmup": "standard"}, frozen=("body",)))
    state = b.init()
    params = _leaves(state.params)
    assert {k: v.tobytes() for k, v in _leaves(state.ema).items()} == \
        {k: v.tobytes() for k, v in params.items()}  # it starts at the initial params
    want = {k: v.astype(np.float64) for k, v in params.items()}
    data, applied = _data(), 0
    for i in range(6):
        batch = {k: v[8 * i: 8 * i + 8] for k, v in data.items()}
        if i == 2:  # a non-finite input: the update is skipped, and so is the average
            batch["inputs"] = batch["inputs"].copy()
            batch["inputs"][3, 1] = np.nan
        before = {k: v.tobytes() for k, v in _leaves(state.ema).items()}
        state, metrics = b.train_step(state, batch)
        if i == 2:
            assert int(metrics["train/status"]) != 0
            assert {k: v.tobytes() for k, v in _leaves(state.ema).items()} == before
            continue
        params = _leaves(state.params)
        d = min(0.9, (1 + applied) / (10 + applied))  # the "standard" warmup
        applied += 1
        want = {k: d * want[k] + (1 - d) * params[k] for k in want}
        got = _leaves(state.ema)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-6, err_msg=k)
    assert applied == 5 and int(state.skipped_steps) == 1
    for k, v in _leaves(state.ema).items():  # optim.frozen: the average is the leaf itself
        if k.startswith("body"):
            assert v.tobytes() == params[k].tobytes(), k
        else:
            assert not np.array_equal(v, params[k]), k
    # eval_params: the EMA in the params' dtypes; the params as they are.
    assert state_lib.eval_params(state, "params") is state.params
    ema = state_lib.eval_params(state, "ema")
    assert jax.tree.map(lambda x: x.dtype, ema) == jax.tree.map(lambda x: x.dtype, state.params)


def test_no_ema_leaves_the_state_tree_and_hash_as_they_were():
    b = _build(_cfg())
    state = b.init()
    assert state.ema is None and b.abstract.ema is None
    assert "ema" not in {str(p[0]) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]}
    with pytest.raises(ValueError, match="optim.ema.decay"):
        state_lib.eval_params(state, "ema")


def test_eval_weights_both_and_a_monitor_on_the_ema_then_init_from(tmp_path):
    cfg = _cfg(ema={"decay": 0.8}, eval_cfg={"every_steps": 3, "weights": "both"},
               checkpoint={"keep_top_k": 1, "monitor": "eval/ema/loss", "every_steps": 3})
    run = str(tmp_path / "run")
    res = jtrain.train(cfg, run, model=Net(), train_data=_data(),
                       eval_data=_data(32, seed=1))
    assert [sorted(k for k in h if k.endswith("loss")) for h in res.history] == \
        [["eval/ema/loss", "eval/loss"]] * 2
    assert res.history[-1]["eval/ema/loss"] != res.history[-1]["eval/loss"]
    with open(os.path.join(run, "metrics.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    assert any("eval/ema/accuracy" in r and "eval/accuracy" in r for r in logged)

    # init_from an export (params only): the average starts at the loaded params.
    export_lib.export(run, str(tmp_path / "ex"))
    source = _leaves(res.state.params)
    source_ema = _leaves(res.state.ema)
    for src, expect in ((str(tmp_path / "ex"), source), (run, source_ema)):
        new = jtrain.resolve({**_cfg(ema={"decay": 0.5}), "init": {"path": src}})
        b = _build(new)
        state, _ = init_from_lib.init_from(new.init, b.abstract_with_shardings(), b.init)
        got = _leaves(state.ema)
        assert sorted(got) == sorted(expect)
        for k in got:
            assert got[k].tobytes() == expect[k].tobytes(), (src, k)


@pytest.mark.parametrize("cfg, key", [
    ({"eval": {"weights": "ema"}}, "eval.weights"),
    ({"optim": {"ema": {"decay": 1.0}}}, "optim.ema.decay"),
    ({"optim": {"ema": {"warmup": "linear"}}}, "optim.ema.warmup"),
])
def test_bad_ema_settings_are_config_errors(cfg, key):
    with pytest.raises(ConfigError) as e:
        jtrain.config.validate(jtrain.resolve(cfg))
    assert e.value.key == key


def test_a_monitor_on_the_ema_without_it_names_the_metrics_there_are(tmp_path):
    cfg = _cfg(ema={"decay": 0.9}, eval_cfg={"every_steps": 3})
    cfg["early_stop"] = {"monitor": "eval/ema/loss"}
    with pytest.raises(ConfigError) as e:
        jtrain.train(cfg, str(tmp_path / "run"), model=Net(), train_data=_data(),
                     eval_data=_data(32, seed=1))
    assert e.value.key == "early_stop.monitor" and "eval/loss" in str(e.value)
