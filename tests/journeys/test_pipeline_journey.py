"""Pipeline stages from the CLI: a layer stack that does not split into the stages is
one line and exit 2; 2 stages x 2 data x 2 fsdp on 8 fake devices under --verify_resume
with gradient accumulation and the weight EMA (killed once and restarted, bitwise
identical), the header stating the bubble; `jtrain sample` and the Hugging Face export
refuse the run in one line."""

import pytest
from journey import run_python

EIGHT = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
FLAGS = ("-m", "jtrain.main", "--config=base:debug", "--config.mesh.stage=2",
         "--config.total_steps=4", "--config.eval.num_batches=1")


def test_cli_refuses_layers_that_do_not_split_into_the_stages(tmp_path):
    proc = run_python(tmp_path, *FLAGS, "--config.model.num_layers=3", "--workdir=runs/p")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "jtrain: config error: mesh.stage: model.num_layers=3 does not split into 2 equal "
        "stages")
    assert not (tmp_path / "runs" / "p" / "checkpoints").exists()


@pytest.mark.slow  # three runs on 8 fake devices: the full suite runs it
def test_cli_two_stages_with_data_and_fsdp_resume_bitwise(tmp_path):
    proc = run_python(tmp_path, *FLAGS, "--config.mesh.data=2", "--config.mesh.fsdp=2",
                      "--config.mesh.microbatches=2", "--config.optim.grad_accum_steps=2",
                      "--config.optim.ema.decay=0.9", "--config.checkpoint.every_steps=1",
                      "--config.checkpoint.async_save=False", "--config.eval.every_steps=2",
                      "--workdir=runs/p", "--verify_resume", "--verify_kills=1",
                      timeout=900, **EIGHT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "verify_resume: PASS: bitwise identical" in out, out[-3000:]
    log = (tmp_path / "runs" / "p" / "reference" / "train.log").read_text()
    assert ("jtrain: pipeline: 2 blocks in 2 stages over mesh.stage, 2 microbatches per "
            "pass (GPipe), bubble 33.3% of each pass ((S-1)/(M+S-1))") in log
    assert "mesh data=2 x fsdp=2 x expert=1 x context=1 x tensor=1 x stage=2" in log
    proc = run_python(tmp_path, "-m", "jtrain", "sample", "runs/p/reference",
                      "--prompt=def ", **EIGHT)
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1].endswith(
        "trained with pipeline stages (mesh.stage > 1): the decoder runs the plain layer "
        "stack"), proc.stderr[-2000:]
    proc = run_python(tmp_path, "-m", "jtrain", "export", "--workdir=runs/p/reference",
                      "--out=exports/p", "--format=hf")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(
        "jtrain: config error: mesh.stage: 2: a run with pipeline stages holds its blocks "
        "stacked per stage"), proc.stderr[-2000:]
    assert not (tmp_path / "exports" / "p").exists()
