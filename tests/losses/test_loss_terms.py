"""A model with a dict of heads, dict targets and a loss returning (loss, {terms}):
trains (also with gradient accumulation), evaluates without crashing, logs each term as
train/<name> and eval/<name> (exact weighted means, padded eval included), and a
monitor may name a term. A plain script with an NNX multi-head model checks the same
as a user sees it."""

import json
import os
import subprocess
import sys

import flax.linen as nn
import numpy as np
import pytest

import jtrain
from jtrain import losses
from jtrain.errors import DataError


class TwoHeads(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        h = nn.relu(nn.Dense(16)(x))
        return {"recon": nn.Dense(4)(h), "cls": nn.Dense(2)(h)}


def loss_fn(outputs, batch):
    recon = losses.mse(outputs["recon"], batch["targets"]["x"])
    cls = losses.masked_cross_entropy(outputs["cls"], batch["targets"]["y"])
    total = recon[0] / recon[1] + 0.5 * cls[0] / cls[1]
    return total, {"recon": recon, "cls": cls}


def _data(n=64, seed=0):
    x = np.random.default_rng(seed).normal(size=(n, 4)).astype(np.float32)
    return {"inputs": x, "targets": {"x": x, "y": (x[:, 0] > 0).astype(np.int32)}}


def _cfg(**over):
    return {"total_steps": 6, "data": {"batch_size": 16, "shuffle": False},
            "eval": {"every_steps": 3}, "log": {"every_steps": 1, "verbosity": 0,
                                                "writers": ("jsonl",)},
            "optim": {"name": "sgd", "lr": 0.05, "schedule": "constant"}, **over}


@pytest.mark.slow  # seconds of CPU: the full suite runs it (tests/README.md)
def test_loss_terms_logged_and_exact_at_eval(tmp_path):
    eval_data = _data(n=13, seed=1)  # 13 rows: the last eval batch is padded
    res = jtrain.train(_cfg(early_stop={"monitor": "eval/recon", "patience": 5}),
                       str(tmp_path / "a"), model=TwoHeads(), train_data=_data(),
                       eval_data=eval_data, loss_fn=loss_fn)
    last = res.history[-1]
    out = jtrain.to_model_fns(TwoHeads()).apply(res.state.params, eval_data["inputs"],
                                                rng=None, train=False)
    recon = np.mean((np.asarray(out["recon"], np.float64) - eval_data["inputs"]) ** 2)
    np.testing.assert_allclose(last["eval/recon"], recon, rtol=1e-5)
    logits = np.asarray(out["cls"], np.float64)
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    ce = -logp[np.arange(13), eval_data["targets"]["y"]].mean()
    np.testing.assert_allclose(last["eval/cls"], ce, rtol=1e-5)
    rows = [json.loads(line) for line in open(tmp_path / "a" / "metrics.jsonl")]
    assert all("train/recon" in r and "train/cls" in r for r in rows if "train/loss" in r)
    # gradient accumulation: the same terms (token-weighted sums over microbatches)
    acc = jtrain.train(_cfg(optim={"name": "sgd", "lr": 0.05, "schedule": "constant",
                                   "grad_accum_steps": 2}), str(tmp_path / "b"),
                       model=TwoHeads(), train_data=_data(), eval_data=eval_data,
                       loss_fn=loss_fn)
    for k in ("train/recon", "train/cls"):
        np.testing.assert_allclose(acc.train_history[0][k], res.train_history[0][k],
                                   rtol=1e-6)


def test_dict_outputs_need_a_loss_fn(tmp_path):
    with pytest.raises(DataError, match="returns a pytree of outputs .* pass loss_fn"):
        jtrain.train(_cfg(), str(tmp_path / "run"), model=TwoHeads(),
                     train_data={"inputs": _data()["inputs"],
                                 "targets": _data()["inputs"]})


SCRIPT = '''
import json
import numpy as np
from flax import nnx
import jtrain
from jtrain import losses

class AE(nnx.Module):
    def __init__(self, rngs):
        self.enc = nnx.Linear(6, 3, rngs=rngs)
        self.dec_rna = nnx.Linear(3, 4, rngs=rngs)
        self.dec_atac = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        z = nnx.tanh(self.enc(x))
        return {"rna": self.dec_rna(z), "atac": self.dec_atac(z)}

def loss_fn(out, batch):
    rna = losses.mse(out["rna"], batch["targets"]["rna"])
    atac = losses.mse(out["atac"], batch["targets"]["atac"])
    return rna[0] / rna[1] + 2.0 * atac[0] / atac[1], {"rna": rna, "atac": atac}

x = np.random.default_rng(0).normal(size=(80, 6)).astype(np.float32)
data = {"inputs": x, "targets": {"rna": x[:, :4], "atac": x[:, 4:]}}
config = {"total_steps": 8, "data": {"batch_size": 8}, "eval": {"every_steps": 4},
          "model": {"dtype": "bfloat16"}}
result = jtrain.train(config, "runs/ae", model=AE(nnx.Rngs(0)), train_data=data,
                      loss_fn=loss_fn)
print("eval terms", sorted(k for k in result.history[-1] if k in ("eval/rna", "eval/atac")))
'''


def test_script_multi_head_nnx_model_with_a_loss_dict_in_bf16(tmp_path):
    (tmp_path / "ae.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    proc = subprocess.run([sys.executable, "ae.py"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**env, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval terms ['eval/atac', 'eval/rna']" in proc.stdout
    assert "compute bfloat16" in proc.stderr
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("jtrain: eval at step 8")]
    assert line and "rna " in line[0] and "atac " in line[0], proc.stderr[-2000:]
