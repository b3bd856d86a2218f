"""A mixture of two packed document sets trained as 2 processes x 1 device over
loopback, stopped after a checkpoint, then resumed as 1 process with 2 fake devices
(elastic 2 -> 1): its state hashes (debug.hash_every_steps=1), step for step, and its
final state_sha256 are those of an uninterrupted 1-process 2-device run, and
summary.json records each component's draws and epochs, as the uninterrupted run's."""

import json
import subprocess
import sys

from journey import free_address, run_python, user_env

SCRIPT = '''
import sys
import jax
import numpy as np
import flax.linen as nn
import jtrain
from jtrain.data import Mixture

workdir, total = sys.argv[1], int(sys.argv[2])
if len(sys.argv) > 3:  # address, number of processes, this process's id
    jax.distributed.initialize(sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))


def docs(seed, n, offset):
    r = np.random.default_rng(seed)
    return [(r.integers(0, 16, r.integers(3, 30)) + offset).astype(np.int32)
            for _ in range(n)]


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(32)(nn.gelu(nn.Embed(32, 16)(x)))


mix = Mixture({"a": docs(1, 40, 0), "b": docs(2, 30, 16)}, weights={"a": 0.6, "b": 0.4})
config = {"seed": 0, "total_steps": total,
          "data": {"batch_size": 4, "seq_len": 16, "packing": "first_fit",
                   "model_inputs": ("inputs",), "mixture_schedule": {4: {"a": 0.2, "b": 0.8}}},
          "optim": {"lr": 1e-2, "warmup_steps": 1, "decay_steps": 8},
          "eval": {"every_steps": 0}, "checkpoint": {"every_steps": 2,
                                                     "allow_changes": ["total_steps"]},
          "log": {"every_steps": 2, "writers": ["jsonl"]}, "debug": {"hash_every_steps": 1}}
r = jtrain.train(config, workdir, model=Model(), train_data=mix)
print("RESULT", jax.process_count(), jax.device_count(), r.summary["resumed_from"],
      r.summary["step"])
'''


def test_mixture_two_processes_then_one_resumes_like_one_run(tmp_path):
    (tmp_path / "mix.py").write_text(SCRIPT)
    address = free_address()
    env = user_env(XLA_FLAGS="--xla_force_host_platform_device_count=1")
    procs = [subprocess.Popen([sys.executable, "mix.py", "runs/el", "4", address, "2",
                               str(i)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    # Meanwhile, the uninterrupted run as 1 process with 2 fake devices.
    ref = run_python(tmp_path, "mix.py", "runs/ref", "8", timeout=600,
                     XLA_FLAGS="--xla_force_host_platform_device_count=2")
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert outs[0][0].split("RESULT ")[1].split() == ["2", "2", "None", "4"]
    assert ref.stdout.split("RESULT ")[1].split() == ["1", "2", "None", "8"]
    resumed = run_python(tmp_path, "mix.py", "runs/el", "8", timeout=600,
                         XLA_FLAGS="--xla_force_host_platform_device_count=2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.split("RESULT ")[1].split() == ["1", "2", "4", "8"]

    el = (tmp_path / "runs" / "el" / "hashes.jsonl").read_text()
    assert [json.loads(line)["step"] for line in el.splitlines()] == list(range(1, 9))
    assert el == (tmp_path / "runs" / "ref" / "hashes.jsonl").read_text()
    summary, ref_summary = (json.loads((tmp_path / "runs" / run / "summary.json").read_text())
                            for run in ("el", "ref"))
    assert summary["state_sha256"] == ref_summary["state_sha256"]
    mix = summary["data"]["mixture"]
    assert sorted(mix) == ["a", "b"] and sum(c["draws"] for c in mix.values()) == 8 * 4
    assert mix == ref_summary["data"]["mixture"]
    assert mix["b"]["weight"] == 0.8 and mix["a"]["epochs"] == round(
        mix["a"]["draws"] / mix["a"]["size"], 3)
