"""log.train_metrics: train/accuracy at a log step is the log step's own batch, computed
in the step from the training forward's outputs with eval's metric definitions, exact
over gradient-accumulation microbatches (counts, not means of means) and devices (two
microbatches on 8 devices: tests/engine/test_auto_shard.py); a gathered metric is a one-line
config error naming the key."""

import numpy as np
import pytest

import jtrain
from jtrain.errors import ConfigError
from numpy_metrics import accuracies

X = np.random.default_rng(1).normal(size=(64, 8)).astype(np.float32)
Y = ((X[:, 0] > 0).astype(np.int32) + 2 * (X[:, 1] > 0.5)).astype(np.int32)
DATA = [{"inputs": a, "targets": b} for a, b in zip(X, Y, strict=True)]


def _run(tmp_path, accum):
    from flax import linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train=False):
            return nn.Dense(4)(nn.relu(nn.Dense(16)(x)))

    # lr 0: the params stay the initial ones, so each batch's outputs are recomputable
    cfg = {"total_steps": 3, "data": {"batch_size": 16, "shuffle": False},
           "optim": {"lr": 0.0, "grad_accum_steps": accum},
           "eval": {"every_steps": 0, "top_k": 2},
           "log": {"every_steps": 1, "writers": ["jsonl"],
                   "train_metrics": ["accuracy", "top_k_accuracy"]}}
    net = Net()
    r = jtrain.train(cfg, str(tmp_path / f"a{accum}"), model=net, train_data=DATA,
                     eval_data=DATA[:16])
    logits = np.asarray(net.apply({"params": r.state.params}, X))
    return r.train_history, logits


def test_train_accuracy_is_the_log_step_batch(tmp_path):
    history, logits = _run(tmp_path, 1)
    for h in history:
        top1, top2 = accuracies(logits, Y, slice((h["step"] - 1) * 16, h["step"] * 16))
        assert h["train/accuracy"] == pytest.approx(top1, abs=1e-12)
        assert h["train/top_2_accuracy"] == pytest.approx(top2, abs=1e-12)


def test_gathered_metrics_are_a_config_error():
    with pytest.raises(ConfigError) as e:
        jtrain.config.resolve({"log": {"train_metrics": ["auroc"]}})
    assert e.value.key == "log.train_metrics" and "gathered" in e.value.why
