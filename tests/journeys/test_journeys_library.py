"""The library as research code uses it, from one plain script (`python research.py` in
an empty temp directory, jtrain imported as installed, absl flags parsed by nobody):

* the public pieces composed into a hand-written loop: make_mesh, make_optimizer,
  to_model_fns, make_abstract_state / init_state, make_train_step, host_to_device;
* a pure `(init, apply)` model (no Flax at all) trained end to end by jtrain.train.

The wheel built from this tree (every module packaged, a user's script training from a
fresh venv): tests/journeys/test_wheel_install.py."""

import json

import pytest

from journey import run_python

DATA = '''
import numpy as np

rng = np.random.default_rng(0)
X = rng.normal(size=(256, 4)).astype(np.float32)
Y = (X[:, 0] - X[:, 1] > 0).astype(np.int32)  # learnable: a linear boundary
'''

HAND_LOOP = DATA + '''
import json
import os

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

import jtrain


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(2)(nn.relu(nn.Dense(16)(x)))


def loss_fn(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


cfg = jtrain.resolve({"total_steps": 40, "optim": {"name": "sgd", "lr": 0.5,
                                                   "schedule": "constant"}})
mesh = jtrain.make_mesh(cfg.mesh)
tx, schedule = jtrain.make_optimizer(cfg.optim, cfg.total_steps)
fns = jtrain.to_model_fns(Net())
policy = jtrain.make_policy(cfg.model)
sample = jax.ShapeDtypeStruct((32, 4), jnp.float32)
abstract, shardings = jtrain.make_abstract_state(fns, tx, policy, sample, mesh, cfg.seed)
state = jtrain.init_state(fns, tx, policy, sample, mesh, cfg.seed, shardings)
assert jax.tree.map(lambda a: a.shape, state.params) == \\
    jax.tree.map(lambda a: a.shape, abstract.params)
step = jax.jit(jtrain.make_train_step(fns.apply, loss_fn, tx, schedule),
               in_shardings=(shardings, jtrain.batch_sharding(mesh)),
               out_shardings=(shardings, None), donate_argnums=0)
losses = []
for i in range(cfg.total_steps):
    rows = slice((i * 32) % 256, (i * 32) % 256 + 32)
    batch = jtrain.host_to_device({"inputs": X[rows], "targets": Y[rows]}, mesh)
    state, metrics = step(state, batch)
    losses.append(float(metrics["train/loss"]))
accuracy = float((fns.apply(state.params, X).argmax(-1) == Y).mean())
print(json.dumps({"step": int(state.step), "first": losses[0], "last": losses[-1],
                  "accuracy": accuracy, "sha": jtrain.state_sha256(state),
                  "listing": sorted(os.listdir("."))}))
'''

PURE = '''
import json
import sys

import jax
import jax.numpy as jnp

import jtrain


def init(rng, x):  # no Flax: a dict of arrays
    k1, k2 = jax.random.split(rng)
    return {"w1": jax.random.normal(k1, (x.shape[-1], 16)) * 0.5, "b1": jnp.zeros(16),
            "w2": jax.random.normal(k2, (16, 2)) * 0.5, "b2": jnp.zeros(2)}


def apply(p, x):
    return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


cfg = {"total_steps": int(sys.argv[2]), "data": {"batch_size": 32},
       "optim": {"name": "sgd", "lr": 0.5, "schedule": "constant"},
       "eval": {"every_steps": 0}, "checkpoint": {"every_steps": 0},
       "log": {"writers": ["jsonl"], "every_steps": 5}}
n = 224
result = jtrain.train(cfg, sys.argv[1], model=(init, apply),
                      train_data={"inputs": X[:n], "targets": Y[:n]},
                      eval_data={"inputs": X[n:], "targets": Y[n:]})
print(json.dumps({"summary": result.summary, "jtrain": jtrain.__file__}))
'''


@pytest.fixture(scope="module")
def research(tmp_path_factory):
    """One plain script, both parts in turn: the hand-written loop, then the pure
    model's jtrain.train (`python research.py runs/pure 30`); the two JSON lines it prints."""
    cwd = tmp_path_factory.mktemp("research")
    (cwd / "research.py").write_text(HAND_LOOP + PURE)
    proc = run_python(cwd, "research.py", "runs/pure", 30)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loop, pure = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    return cwd, loop, pure


def test_hand_written_loop_from_the_public_pieces(research):
    _, out, _ = research
    assert out["step"] == 40
    assert out["last"] < 0.5 * out["first"], out
    assert out["accuracy"] > 0.9, out
    assert out["listing"] == ["research.py"]  # a library call writes nothing


def test_pure_init_apply_model_trains_end_to_end(research):
    cwd, _, out = research
    s = out["summary"]
    assert s["step"] == 30 and s["eval/accuracy"] > 0.85, s
    assert (cwd / "runs" / "pure" / "summary.json").is_file()
    records = [json.loads(ln) for ln in
               (cwd / "runs" / "pure" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == [5, 10, 15, 20, 25, 30]
