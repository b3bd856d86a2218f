"""2 processes x 1 device over loopback against 1 process with 2 fake devices: the same
global mesh (fsdp=2, so params, the weight EMA and schedule-free's state are split
across the processes), the same user script with optim.ema.decay, schedule_free_adamw
and debug.hash_every_steps=1. The state hashes are identical step for step, only
process 0 writes hashes.jsonl, and `jtrain diff`'s comparison of the two runs finds them
identical (its command-line journeys are tests/journeys/test_forensics_journey.py's)."""

import json
import subprocess
import sys

from journey import free_address, run_python, user_env
from jtrain.diff import diff_runs

STEPS = 4

SCRIPT = '''
import sys
import jax
import numpy as np
import jtrain

workdir = sys.argv[1]
if len(sys.argv) > 2:  # address, number of processes, this process's id
    jax.distributed.initialize(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))

rng = np.random.default_rng(0)
x = rng.normal(size=(256, 16)).astype(np.float32)
y = (x[:, :8].sum(1) > x[:, 8:].sum(1)).astype(np.int32)
config = {"seed": 0, "total_steps": %d,
          "model": {"name": "mlp", "hidden": (32, 32), "num_outputs": 2},
          "data": {"batch_size": 16}, "mesh": {"fsdp": 2},
          "optim": {"name": "schedule_free_adamw", "lr": 1e-2, "schedule": "constant",
                    "ema": {"decay": 0.9}},
          "eval": {"every_steps": 0, "num_batches": 1}, "checkpoint": {"every_steps": 2},
          "log": {"every_steps": 1, "writers": ["jsonl"]}, "debug": {"hash_every_steps": 1}}
result = jtrain.train(config, workdir, train_data=(x, y))
print("RESULT", jax.process_index(), jax.process_count(), jax.device_count(),
      result.summary["step"])
''' % STEPS


def test_two_processes_hash_like_one_process_with_two_devices(tmp_path):
    (tmp_path / "sf_ema.py").write_text(SCRIPT)
    address = free_address()
    one_device = user_env(XLA_FLAGS="--xla_force_host_platform_device_count=1")
    procs = [subprocess.Popen([sys.executable, "sf_ema.py", "runs/mp", address, "2", str(i)],
                              cwd=tmp_path, env=one_device, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    # Meanwhile, the same run as 1 process with 2 fake devices.
    single = run_python(tmp_path, "sf_ema.py", "runs/one", timeout=600,
                        XLA_FLAGS="--xla_force_host_platform_device_count=2")
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert single.returncode == 0, single.stderr[-3000:]
    assert [o[0].split("RESULT ")[1].split() for o in outs] == [
        ["0", "2", "2", str(STEPS)], ["1", "2", "2", str(STEPS)]]
    assert single.stdout.split("RESULT ")[1].split() == ["0", "1", "2", str(STEPS)]

    two = (tmp_path / "runs" / "mp" / "hashes.jsonl").read_text()
    rows = [json.loads(line) for line in two.splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # one writer: process 0
    assert set(rows[0]["parts"]) == {"params", "opt_state", "ema", "rest"}
    assert (tmp_path / "runs" / "one" / "hashes.jsonl").read_text() == two
    # The first evaluation of a schedule-free run compiles its average once, not per leaf.
    assert " again " not in outs[0][1], outs[0][1][-3000:]

    diff = diff_runs(str(tmp_path / "runs" / "mp"), str(tmp_path / "runs" / "one"))
    assert diff["identical"] is True, diff  # what `jtrain diff` exits 0 for
