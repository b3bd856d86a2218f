"""mesh.expert as a user runs it: the dry run of 8 fake devices (data 2 x fsdp 2 x
expert 2) shows the experts' weights divided by fsdp x expert; --verify_resume on 2
devices with expert 2 ends bitwise (routing is deterministic across a kill) and the run
samples; a population on the expert axis is refused in one line; a delayed
FP8 scaling is refused in one line."""

from journey import run_python

CONFIG = '''
from jtrain.config import defaults


def get_config():
    c = defaults(model="transformer")
    c.update({"total_steps": 8, "seed": 0,
              "model": dict(d_model=32, num_layers=2, num_heads=2, d_ff=64, max_len=16,
                            moe=dict(experts=4, k=2, capacity_factor=1.0)),
              "data": dict(seq_len=16, batch_size=8), "optim": dict(lr=3e-3),
              "eval": dict(every_steps=0, num_batches=1),
              "checkpoint": dict(every_steps=2), "mesh": dict(data=1, expert=2)})
    return c
'''


def test_dry_run_shows_the_experts_divided_by_the_axis(tmp_path):
    (tmp_path / "cfg.py").write_text(CONFIG)
    p = run_python(tmp_path, "-m", "jtrain.main", "--config=cfg.py", "--workdir=run",
                   "--dry_run", "--dry_run_devices=8", "--config.mesh.data=2",
                   "--config.mesh.fsdp=2")
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "mesh data=2 x fsdp=2 x expert=2 x context=1 x tensor=1" in out
    assert ("layer_0..1/moe/wi: [4, 32, 64], P(('fsdp', 'expert'), None, 'tensor') -> "
            "[1, 32, 64]") in out
    assert "nothing was initialised or run" in out


def test_verify_resume_with_expert_2_is_bitwise(tmp_path):
    (tmp_path / "cfg.py").write_text(CONFIG)
    p = run_python(tmp_path, "-m", "jtrain.main", "--config=cfg.py", "--workdir=run",
                   "--verify_resume", "--verify_kills=1", "--config.checkpoint.every_steps=1",
                   "--config.checkpoint.async_save=False", timeout=600,
                   XLA_FLAGS="--xla_force_host_platform_device_count=2")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "jtrain: verify_resume: PASS: bitwise identical" in p.stdout + p.stderr
    p = run_python(tmp_path, "-m", "jtrain", "sample", "run/reference", "--prompt", "def ",
                   "--max_new_tokens=4")  # decoded on one device
    assert p.returncode == 0 and "4 tokens in" in p.stderr, p.stderr[-2000:]


def test_a_population_on_the_expert_axis_is_refused_in_one_line(tmp_path):
    (tmp_path / "cfg.py").write_text(CONFIG)
    p = run_python(tmp_path, "-m", "jtrain.main", "--config=cfg.py", "--workdir=run",
                   "--config.population.size=2",
                   XLA_FLAGS="--xla_force_host_platform_device_count=2")
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip().splitlines() == [
        "jtrain: config error: mesh.expert: not implemented for a population "
        "(population.size > 1); use mesh.fsdp for the experts"]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_delayed_fp8_scaling_is_refused_in_one_line(tmp_path):
    (tmp_path / "cfg.py").write_text(CONFIG)
    p = run_python(tmp_path, "-m", "jtrain.main", "--config=cfg.py", "--workdir=run",
                   "--config.model.moe.experts=0", "--config.model.quant=fp8",
                   "--config.model.quant_scaling=delayed")
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip().splitlines() == [
        "jtrain: config error: model.quant_scaling: delayed scaling (an amax history kept "
        "in the train state) is not in qwix 0.1.8, which scales each matmul from its "
        "operands' absmax in the batch; use 'current'"]
