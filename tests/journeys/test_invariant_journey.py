"""determinism.topology_invariant as a user runs it: one script with their NNX model,
trained on 1 process x 8 devices, on 2 processes x 2 devices, and elastically (4 devices
to step 2, then resumed on 2 devices): the per-step state hashes (with the example
indices), the final eval and `jtrain diff` all agree bitwise."""

import json
import subprocess
import sys

from journey import free_address, run_python, user_dir, user_env

STEPS = 4

SCRIPT = '''
import sys
import jax
import jtrain
import nnx_mlp

workdir, total = sys.argv[1], int(sys.argv[2])
if len(sys.argv) > 3:  # address, number of processes, this process's id
    jax.distributed.initialize(sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
config = {"seed": 0, "total_steps": total, "data": {"batch_size": 16},
          "optim": {"name": "adamw", "lr": 3e-2, "clip_norm": 0.5, "schedule": "constant"},
          "mesh": {"fsdp": 2, "data": -1, "auto_shard_min_bytes": 0},
          "eval": {"every_steps": 2}, "checkpoint": {"every_steps": 2},
          "log": {"writers": ["jsonl"]}, "debug": {"hash_every_steps": 1},
          "determinism": {"topology_invariant": True, "chunks": 8}}
result = jtrain.train(config, workdir, model=nnx_mlp.make(), train_data=nnx_mlp.data(64),
                      eval_data=nnx_mlp.data(40), allow_changes=["total_steps"])
print("RESULT", jax.process_count(), jax.device_count(), result.summary["step"])
'''


def _devices(n):
    return {"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}


def _evals(path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if k.startswith("eval/")} for r in rows
            if any(k.startswith("eval/") for k in r)]


def test_same_hashes_on_8_devices_2_processes_and_after_elastic_resume(tmp_path):
    user_dir(tmp_path, projects=("nnx_mlp",), files={"train.py": SCRIPT})
    address = free_address()
    procs = [subprocess.Popen([sys.executable, "train.py", "runs/mp", str(STEPS), address,
                               "2", str(i)], cwd=tmp_path, env=user_env(**_devices(2)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    eight = run_python(tmp_path, "train.py", "runs/eight", str(STEPS), **_devices(8))
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert eight.returncode == 0, eight.stderr[-3000:]
    assert "RESULT 2 4 4" in outs[0][0]
    first = run_python(tmp_path, "train.py", "runs/elastic", "2", **_devices(4))
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_python(tmp_path, "train.py", "runs/elastic", str(STEPS), **_devices(2))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resum" in second.stderr.lower()

    runs = tmp_path / "runs"
    reference = (runs / "eight" / "hashes.jsonl").read_text()
    assert len(reference.splitlines()) == STEPS
    for name in ("mp", "elastic"):
        assert (runs / name / "hashes.jsonl").read_text() == reference, name
        assert _evals(runs / name / "metrics.jsonl") == _evals(runs / "eight" / "metrics.jsonl")
    assert len(_evals(runs / "eight" / "metrics.jsonl")) == 2
    proc = run_python(tmp_path, "-m", "jtrain.diff", "runs/mp", "runs/eight")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "identical" in proc.stderr
