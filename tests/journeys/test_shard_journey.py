"""A user trains their own unannotated NNX classifier from the CLI (`model.factory`) on 8
fake devices with mesh.fsdp=8 and log.train_metrics=accuracy: the header says the
params' bytes per device (sharded by mesh.auto_shard) and metrics.jsonl has
train/accuracy at each log step."""

import json

from journey import run_python

MODELS = '''
import numpy as np
from flax import nnx

class Classifier(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(16, 64, rngs=rngs)
        self.out = nnx.Linear(64, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))

def make():
    return Classifier  # jtrain builds it with rngs, shapes first

def data():
    x = np.random.default_rng(0).normal(size=(128, 16)).astype(np.float32)
    return {"inputs": x, "targets": (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 1)}
'''

CONFIG = '''
from jtrain.config import defaults

def get_config():
    config = defaults(model="user")
    config.model.factory = "mymodels:make"
    config.data.source = "mymodels:data"
    config.data.batch_size = 16
    config.total_steps = 4
    config.log.every_steps = 2
    config.log.train_metrics = ("accuracy",)   # -> train/accuracy in metrics.jsonl
    config.mesh.update(data=1, fsdp=8)      # your unannotated model, sharded 8 ways
    return config
'''


def test_cli_user_model_sharded_with_train_accuracy(tmp_path):
    (tmp_path / "mymodels.py").write_text(MODELS)
    (tmp_path / "myconfig.py").write_text(CONFIG)
    proc = run_python(tmp_path, "-m", "jtrain.main", "--config=myconfig.py",
                      "--workdir=runs/c", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # hidden kernel [16, 64] (4 KiB) on fsdp; the rest under 4 KiB stays replicated
    total = (16 * 64 + 64 + 64 * 3 + 3) * 4
    per = total - 16 * 64 * 4 * 7 // 8
    assert (f"jtrain: sharding: params {per:,} of {total:,} bytes per device (1 leaves "
            "sharded, 0 replicated, 3 too small") in proc.stderr, proc.stderr[-3000:]
    assert "shards no parameter" not in proc.stderr
    lines = [json.loads(x) for x in open(tmp_path / "runs/c/metrics.jsonl")]
    acc = [x["train/accuracy"] for x in lines if "train/accuracy" in x]
    assert len(acc) == 2 and all(0.0 <= a <= 1.0 for a in acc)
    record = json.load(open(tmp_path / "runs/c/run.json"))["decided"]["mesh.auto_shard"]
    assert record["value"] is True and record["params"]["per_device_bytes"] == per
