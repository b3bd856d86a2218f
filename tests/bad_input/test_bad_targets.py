"""Targets that would train wrong without an error are refused before the first step,
one line naming the split, the example and the fix: class labels outside the model's
classes, and regression targets the default MSE would broadcast against the outputs.
From Python (a user's Linen model) and from the CLI (a user's config and data module)."""

import os
import subprocess
import sys

import flax.linen as nn
import numpy as np
import pytest

import jtrain
from jtrain.errors import DataError


class Classifier(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(3)(x)


class Regressor(nn.Module):
    width: int = 1

    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(self.width)(x)  # [B, width]


def _x(n=32):
    return np.random.default_rng(0).normal(size=(n, 4)).astype(np.float32)


def _labels(bad_value=None, n=32):
    y = np.arange(n, dtype=np.int32) % 3
    if bad_value is not None:
        y[5] = bad_value
    return y


def masked_ce(outputs, batch):  # a user loss with an ignore index
    return jtrain.losses.masked_cross_entropy(outputs, batch["targets"])


CFG = {"total_steps": 2, "data": {"batch_size": 8, "val_fraction": 0.0},
       "eval": {"every_steps": 0}, "log": {"verbosity": 0}}


@pytest.mark.parametrize("model, data, loss_fn, error", [
    (Classifier(), {"inputs": _x(), "targets": _labels(-1)}, None,
     "train_data: example 5 has class label -1, outside 0..2 (the model has 3 outputs)"),
    (Classifier(), {"inputs": _x(), "targets": _labels(3)}, None,
     "train_data: example 5 has class label 3, outside 0..2"),
    (Classifier(), {"inputs": _x(), "targets": _labels(7)}, masked_ce,
     "train_data: example 5 has class label 7"),  # never a valid class, whatever the loss
    (Regressor(), {"inputs": _x(), "targets": _x()[:, 0]}, None,
     "train_data: targets of shape () per example against model outputs of shape (1,): "
     "the default MSE would broadcast them"),
    (Regressor(2), {"inputs": _x(), "targets": _x()[:, :1]}, None,
     "train_data: targets of shape (1,) per example against model outputs of shape (2,)"),
    (Classifier(), {"inputs": _x(), "targets": _labels(-100)}, masked_ce, None),  # ignored
    (Classifier(), {"inputs": _x(), "targets": _labels(-1),
                    "weights": (np.arange(32) != 5).astype(np.float32)}, None, None),
    (Regressor(), {"inputs": _x(), "targets": _x()[:, :1]}, None, None),  # (1,) vs (1,)
    (Classifier(), {"inputs": _x(), "targets": np.stack([_labels()] * 2, 1)}, None,
     "train_data: integer targets (class labels) of shape (2,) per example need model "
     "outputs of shape (2,) + (classes,), got (3,)"),
])
def test_targets_checked_before_the_first_step(tmp_path, model, data, loss_fn, error):
    run = lambda: jtrain.train(CFG, str(tmp_path / "run"), model=model,  # noqa: E731
                               train_data=data, loss_fn=loss_fn)
    if error is None:
        assert run().summary["step"] == 2
        return
    with pytest.raises(DataError) as e:
        run()
    assert str(e.value).startswith(error), str(e.value)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_cli_label_out_of_range_is_one_line_exit_2(tmp_path):
    (tmp_path / "mydata.py").write_text(
        "import numpy as np\n"
        "def make():\n"
        "    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)\n"
        "    y = (x[:, 0] > 0).astype(np.int32)\n"
        "    y[40] = 2  # a third class the 2-output model does not have\n"
        "    return {'train': {'inputs': x[:48], 'targets': y[:48]},\n"
        "            'eval': {'inputs': x[48:], 'targets': y[48:]}}\n")
    (tmp_path / "myconfig.py").write_text(
        "from jtrain.config import defaults\n"
        "def get_config():\n"
        "    c = defaults(model='mlp')\n"
        "    c.model.num_outputs = 2\n"
        "    c.data.source = 'mydata:make'\n"
        "    c.data.batch_size = 8\n"
        "    c.total_steps = 4\n"
        "    return c\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    proc = subprocess.run([sys.executable, "-m", "jtrain.main", "--config=myconfig.py",
                           "--workdir=runs/x"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**env, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if " error: " in ln]
    assert lines == ["jtrain: data error: train_data: example 40 has class label 2, outside "
                     "0..1 (the model has 2 outputs); fix the labels, give the model more "
                     "outputs, or give such labels weight 0 (batch['weights'])"], proc.stderr
    assert "Traceback" not in proc.stderr


def test_workdir_that_is_a_file_or_read_only_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("not a run")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    data = {"inputs": _x(), "targets": _labels()}
    try:
        for workdir, why in [(tmp_path / "afile", "is a file, not a directory"),
                             (locked / "run", "is not writable")]:
            if why == "is not writable" and os.access(locked, os.W_OK):
                continue  # running as a user that ignores permissions (root)
            with pytest.raises(jtrain.errors.WorkdirError, match=why):
                jtrain.train(CFG, str(workdir), model=Classifier(), train_data=data)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        proc = subprocess.run([sys.executable, "-m", "jtrain.main",
                               f"--config={repo}/configs/base.py:debug", "--workdir=afile"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300,
                              env={**env, "JAX_PLATFORMS": "cpu"})
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1].startswith(
            "jtrain: workdir error: ") and "is a file" in proc.stderr
        assert (tmp_path / "afile").read_text() == "not a run"  # nothing overwritten
    finally:
        locked.chmod(0o700)
