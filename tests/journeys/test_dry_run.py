"""`--dry_run` as a user runs it: a 64-device FSDP x TP layout checked on fake CPU
devices (memory, every parameter's sharding, exit 0, nothing written) and a layout the
model cannot take (one line naming the parameter path, exit 2)."""

import os

from journey import run_python

CONFIG = '''
from jtrain.config import defaults


def get_config():
    c = defaults(model="transformer")
    c.update({"total_steps": 10,
              "model": dict(d_model=64, num_layers=2, num_heads=4, d_ff=128, max_len=32),
              "data": dict(seq_len=32, batch_size=32), "eval": {"batch_size": 64},
              "mesh": dict(data=2, fsdp=8, tensor=4)})
    return c
'''


def _dry_run(cwd, *extra):
    return run_python(cwd, "-m", "jtrain.main", "--config=cfg.py", "--workdir=run",
                      "--dry_run", "--dry_run_devices=64", *extra)


def test_dry_run_of_64_devices_fsdp_x_tensor(tmp_path):
    (tmp_path / "cfg.py").write_text(CONFIG)
    p = _dry_run(tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert ("dry run on 64 cpu devices, mesh data=2 x fsdp=8 x expert=1 x context=1 x "
            "tensor=4 x stage=1") in out
    # Each parameter group with its spec and per-device shape; layers folded into one line.
    assert "layer_0..1/attn/query: [64, 4, 16], P('fsdp', 'tensor', None) -> [8, 1, 16]" \
        in out
    assert "embed/embedding: [256, 64], P('tensor', 'fsdp') -> [64, 8]" in out
    assert "jtrain: train_step per device: argument" in out
    assert "jtrain: eval_step per device: argument" in out
    assert "nothing was initialised or run" in out
    assert not os.path.exists(tmp_path / "run")  # a dry run writes nothing


def test_dry_run_names_the_parameter_the_mesh_cannot_shard(tmp_path):
    (tmp_path / "cfg.py").write_text(CONFIG)
    # 4 heads over tensor=8: the attention weights' head dimension does not divide.
    p = _dry_run(tmp_path, "--config.mesh.tensor=8", "--config.mesh.fsdp=4")
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in p.stderr
    assert err[0].startswith("jtrain: config error: mesh.tensor: layer_0/attn/key "
                             "[64, 4, 16]: dim 1 (4, 'heads') is not divisible by tensor=8")
    # A batch the mesh cannot split: the same one line as a real run.
    p = _dry_run(tmp_path, "--config.data.batch_size=8")
    assert p.returncode == 2 and "data.batch_size" in p.stderr
