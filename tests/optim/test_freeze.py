"""Freezing and per-parameter learning rates: optim.trainable / optim.frozen keep frozen
leaves bitwise unchanged under AdamW with weight decay and give them no optimizer state;
optim.lr_mults scales a leaf's learning rate; regexes that match nothing are one-line
config errors; the CLI and a plain script with a user's NNX model show the split."""

import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import jtrain
from journey import copy_project, run_python
from jtrain.errors import ConfigError


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        h = nn.relu(nn.Dense(16, name="body")(x))
        return nn.Dense(3, name="head")(h)


def _data(n=64):
    r = np.random.default_rng(0)
    x = r.normal(size=(n, 4)).astype(np.float32)
    return {"inputs": x, "targets": (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0)}


def _cfg(total_steps=6, **optim):
    return {"total_steps": total_steps, "seed": 0, "data": {"batch_size": 8},
            "eval": {"every_steps": 0}, "log": {"verbosity": 0, "writers": ("jsonl",)},
            "optim": {"name": "adamw", "lr": 0.05, "weight_decay": 0.1,
                      "schedule": "constant", **optim}}


def _initial(cfg):
    data = _data()
    b = jtrain.build(jtrain.resolve(cfg), sample=data["inputs"][0], model=Net(),
                     eval_example={"inputs": data["inputs"][0], "targets": data["targets"][0]})
    return b, b.init()


def _leaves(tree):
    return {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("optim", [{"frozen": ("body",)}, {"trainable": ("head",)}])
def test_frozen_leaves_are_bitwise_unchanged_and_have_no_optimizer_state(tmp_path, optim):
    cfg = _cfg(**optim)
    b, init = _initial(cfg)
    assert b.trainable == {"train": (2, 51), "frozen": (2, 80)}
    res = jtrain.train(cfg, str(tmp_path / "run"), model=Net(), train_data=_data())
    before, after = _leaves(init.params), _leaves(res.state.params)
    for name in before:
        if name.startswith("body"):
            assert before[name].tobytes() == after[name].tobytes(), name  # weight decay too
        else:
            assert not np.array_equal(before[name], after[name]), name
    # Adam's moments exist for the head only (MaskedNode for the frozen body).
    shapes = sorted(x.shape for x in jax.tree.leaves(res.state.opt_state) if x.ndim)
    assert shapes == sorted([(3,), (16, 3)] * 2)
    masked = jax.tree.leaves(res.state.opt_state,
                             is_leaf=lambda x: isinstance(x, optax.MaskedNode))
    assert sum(isinstance(x, optax.MaskedNode) for x in masked) == 4  # mu, nu x 2 leaves


def test_lr_mults_scale_the_learning_rate_of_matching_leaves(tmp_path):
    sgd = {"name": "sgd", "kwargs": {"momentum": 0.0}, "weight_decay": 0.0}
    doubled = jtrain.train(_cfg(**sgd, lr=0.05, lr_mults={"body": 2.0, "head": 0.0}),
                           str(tmp_path / "a"), model=Net(), train_data=_data())
    plain = jtrain.train(_cfg(**sgd, lr=0.1, total_steps=1), str(tmp_path / "b"),
                         model=Net(), train_data=_data())
    _, init = _initial(_cfg(**sgd))
    a, b0, p = _leaves(doubled.state.params), _leaves(init.params), _leaves(plain.state.params)
    assert all(np.array_equal(a[n], b0[n]) for n in a if n.startswith("head"))
    # after one step, the body moved exactly as with lr 0.1 (one step of each, compared)
    one = jtrain.train(_cfg(**sgd, lr=0.05, total_steps=1, lr_mults={"body": 2.0}),
                       str(tmp_path / "c"), model=Net(), train_data=_data())
    o = _leaves(one.state.params)
    for n in o:
        if n.startswith("body"):
            np.testing.assert_allclose(o[n], p[n], rtol=0, atol=1e-7)


@pytest.mark.parametrize("optim, key", [
    ({"frozen": ("encoder",)}, "optim.frozen"),  # matches no parameter
    ({"trainable": ("(",)}, "optim.trainable"),  # not a regex
    ({"trainable": ("body",), "frozen": ("body",)}, "optim.trainable"),  # nothing trains
    ({"lr_mults": {"head": "fast"}}, "optim.lr_mults"),
])
def test_bad_freezing_config_is_a_config_error(tmp_path, optim, key):
    with pytest.raises(ConfigError) as e:
        jtrain.train(_cfg(**optim), str(tmp_path / "run"), model=Net(), train_data=_data())
    assert e.value.key == key
    assert not (tmp_path / "run" / "checkpoints").exists()


SCRIPT = '''
import numpy as np
from flax import nnx
import jtrain
from nnx_mlp import Model, data

model = Model(nnx.Rngs(0))
before = np.asarray(model.encoder.kernel[...]).copy()
config = {"total_steps": 5, "data": {"batch_size": 8}, "eval": {"every_steps": 0},
          "optim": {"name": "adamw", "lr": 0.05, "weight_decay": 0.1, "frozen": ["encoder"]}}
result = jtrain.train(config, "runs/ft", model=model, train_data=data(64))
after = np.asarray(result.state.params["encoder"]["kernel"])
print("encoder unchanged:", bool((before == after).all()))
'''


def test_script_nnx_model_frozen_encoder(tmp_path):
    copy_project(tmp_path, "nnx_mlp")
    (tmp_path / "finetune.py").write_text(SCRIPT)
    proc = run_python(tmp_path, "finetune.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "encoder unchanged: True" in proc.stdout
    assert "jtrain: trainable 34 params in 2 leaves; frozen 80 in 2 leaves" in proc.stderr
    assert json.load(open(tmp_path / "runs/ft/summary.json"))["step"] == 5


def test_cli_frozen_with_a_bad_regex_is_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-m", "jtrain.main", f"--config={repo}/configs/base.py:debug",
         "--workdir=runs/x", "--config.optim.frozen=('decoder',)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**env, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = [ln for ln in proc.stderr.splitlines() if " error: " in ln]
    assert len(line) == 1 and line[0].startswith(
        "jtrain: config error: optim.frozen: 'decoder' matches no parameter path; "
        "paths look like"), proc.stderr[-2000:]
