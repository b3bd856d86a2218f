"""mesh.context as a user runs it from the command line on fake CPU devices: a sequence
whose train step does not fit a stated memory budget on one device fits when split over
two (the dry run's per-device report shrinks), a run split over context 2 is killed and
resumed bitwise (--verify_resume, one kill) and sampled on one device, and a model of the user's
own is refused in one line."""

import re

from journey import run_python

CONFIG = '''
from jtrain.config import defaults


def get_config():
    c = defaults(model="transformer")
    c.update({"total_steps": 6, "checkpoint": {"every_steps": 2},
              "model": dict(d_model=32, num_layers=1, num_heads=4, d_ff=64, max_len=512),
              "data": dict(seq_len=512, batch_size=1), "eval": {"num_batches": 1},
              "mesh": dict(data=1)})
    return c
'''


USER = '''
from jtrain.config import defaults


def get_config():
    c = defaults(model="user")
    c.update({"model": {"factory": "mymodel:make"}, "mesh": {"context": 2}})
    return c
'''


def _run(cwd, devices, *extra):
    return run_python(cwd, "-m", "jtrain.main", "--config=cfg.py", "--workdir=run", *extra,
                      timeout=600,
                      XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")


def _peak_mib(out: str) -> float:
    return float(re.search(r"train_step per device: .*peak estimate ([0-9.]+) MiB",
                           out).group(1))


def test_context_splits_what_one_device_cannot_hold_and_resumes(tmp_path):
    (tmp_path / "cfg.py").write_text(CONFIG)
    budget = "--config.memory.budget_bytes=10485760"  # 10 MiB per device
    one = _run(tmp_path, 1, "--dry_run", budget)
    assert one.returncode == 2, one.stdout[-2000:] + one.stderr[-2000:]
    err = one.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jtrain: config error: memory.budget_bytes: "
                                               "the train step needs"), one.stderr
    assert "mesh.context" in err[0]
    split = _run(tmp_path, 2, "--dry_run", budget, "--config.mesh.context=2")
    assert split.returncode == 0, split.stdout[-2000:] + split.stderr[-2000:]
    assert "mesh data=1 x fsdp=1 x expert=1 x context=2 x tensor=1" in split.stdout
    needed = float(re.search(r"needs ([0-9.]+) MiB per device", err[0]).group(1))
    assert _peak_mib(split.stdout) < 0.6 * needed, (split.stdout, err[0])

    # one kill proves the split state resumes (a checkpoint each step, saved before the
    # next, so the restart has one to resume from); tests/verify/test_resume_chaos.py covers
    # the verifier's kinds of kill
    resumed = _run(tmp_path, 2, "--verify_resume", "--verify_kills=1", "--config.mesh.context=2",
                   "--config.checkpoint.every_steps=1", "--config.checkpoint.async_save=False",
                   "--config.data.seq_len=32", "--config.model.max_len=32")
    lines = [ln for ln in resumed.stdout.splitlines() if ln.startswith("jtrain: verify_resume:")]
    assert resumed.returncode == 0 and len(lines) == 1, resumed.stdout[-3000:] + resumed.stderr
    assert lines[0].startswith("jtrain: verify_resume: PASS: bitwise identical"), lines[0]
    sample = run_python(tmp_path, "-m", "jtrain", "sample", "run/reference", "--prompt=hi",
                        "--max_new_tokens=4")  # decoding runs unsplit, on one device
    assert sample.returncode == 0 and "finish: length" in sample.stdout + sample.stderr, \
        sample.stderr[-2000:]

    (tmp_path / "user.py").write_text(USER)
    own = run_python(tmp_path, "-m", "jtrain.main", "--config=user.py", "--workdir=own",
                     XLA_FLAGS="--xla_force_host_platform_device_count=2")
    assert own.returncode == 2 and "Traceback" not in own.stderr, own.stderr[-2000:]
    assert own.stderr.strip() == ("jtrain: config error: mesh.context: 2 splits the built-in "
                                  "transformer's sequences; not implemented with "
                                  "model.name='user': set mesh.context=1"), own.stderr
