"""The precision report as users see it: a plain script trains an NNX model whose layers
cast back to float32 and a Linen model that honours the policy (model.dtype=bfloat16);
the CLI trains a `model.factory` model that takes a dtype argument. The header says what
each computes in, the cast-back model gets the one-line warning, summary.json records
configured and measured."""

import json

from journey import run_python, user_dir

SCRIPT = '''
import jtrain
from precision_models import CastsBack, Honours, data

config = {"total_steps": 2, "data": {"batch_size": 16}, "model": {"dtype": "bfloat16"}}
jtrain.train(config, "runs/nnx", model=CastsBack, train_data=data())
jtrain.train(config, "runs/linen", model=Honours(), train_data=data())
'''

CONFIG = '''
from jtrain.config import defaults

def get_config():
    config = defaults(model="user")
    config.model.factory = "precision_models:make"
    config.model.dtype = "bfloat16"
    config.data.source = "precision_models:data"
    config.data.batch_size = 16
    config.total_steps = 2
    return config
'''

WARNING = ("jtrain: warning: model.dtype=bfloat16, but the model computes 1 of 1 matmuls "
           "in float32: its layers set their own dtype; build it with dtype=..., or give "
           "model.factory a dtype argument")


def test_the_header_and_summary_say_what_the_model_computes_in(tmp_path):
    user_dir(tmp_path, ["precision_models"], {"train_both.py": SCRIPT, "myconfig.py": CONFIG})
    proc = run_python(tmp_path, "train_both.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("jtrain: model user CastsBack (nnx), 8 params, params float32, compute "
            "bfloat16 (model: 0/1 matmuls bfloat16; 1 float32)\n") in proc.stderr
    assert proc.stderr.count(WARNING) == 1
    assert ("jtrain: model user Honours (linen), 58 params, params float32, compute "
            "bfloat16 (model: 2/2 matmuls bfloat16)\n") in proc.stderr
    summary = json.load(open(tmp_path / "runs/nnx/summary.json"))
    assert summary["precision"] == {"params": "float32", "compute": "bfloat16",
                                    "dynamic_loss_scale": False,
                                    "measured_matmuls": {"float32": 1}}

    proc = run_python(tmp_path, "-m", "jtrain.main", "--config=myconfig.py",
                      "--workdir=runs/cli")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compute bfloat16 (model: 2/2 matmuls bfloat16)" in proc.stderr
    assert "jtrain: warning: model.dtype" not in proc.stderr
    summary = json.load(open(tmp_path / "runs/cli/summary.json"))
    assert summary["precision"]["measured_matmuls"] == {"bfloat16": 2}
