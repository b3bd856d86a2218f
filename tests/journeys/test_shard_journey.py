"""A user trains their own unannotated NNX classifier from the CLI (`model.factory`) on 8
fake devices with mesh.fsdp=8 and log.train_metrics=accuracy: the header says the
params' bytes per device (sharded by mesh.auto_shard) and metrics.jsonl has
train/accuracy at each log step (the examples of docs/guide/sharding.md)."""

import json

from journey import copy_project, run_python

CONFIG = '''
from jtrain.config import defaults

def get_config():
    config = defaults(model="user")
    config.update({
        "model": {"factory": "mymodels:make",  # your unannotated NNX model
                  "kwargs": {"features": 16, "hidden": 64, "classes": 3}},
        "data": {"source": "mydata:make", "batch_size": 16,
                 "kwargs": {"n": 128, "train": None, "features": 16, "classes": 3}},
        "total_steps": 4,
        "log": {"every_steps": 2, "train_metrics": ("accuracy",)},  # -> metrics.jsonl
        "mesh": {"data": 1, "fsdp": 8},  # sharded 8 ways
    })
    return config
'''


def test_cli_user_model_sharded_with_train_accuracy(tmp_path):
    copy_project(tmp_path, "mymodels", "mydata")
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
