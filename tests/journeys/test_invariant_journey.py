"""determinism.topology_invariant as a user runs it: one script with their NNX model,
trained on 1 device, and on 2 processes x 2 devices to step 2, resumed elastically on 1
process with 2 devices to step 4, then on 1 device to step 6: the per-step state hashes
(with the example indices), the evals and `jtrain diff` all agree bitwise. (1, 2, 4 and
8 devices in one process: tests/engine/test_invariant_multidevice.py.)"""

import json
import runpy
import subprocess
import sys

from journey import free_address, run_python, user_dir, user_env

STEPS = 6

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
          "mesh": {"fsdp": min(2, jax.device_count()), "data": -1, "auto_shard_min_bytes": 0},
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


def test_same_hashes_on_1_device_2_processes_and_after_elastic_resumes(tmp_path, monkeypatch,
                                                                    capsys):
    user_dir(tmp_path, projects=("nnx_mlp",), files={"train.py": SCRIPT})
    address = free_address()
    # The user's script on 2 processes x 2 devices to step 2, then resumed elastically: on
    # 1 process with 2 devices to step 4, on 1 device to step 6.
    procs = [subprocess.Popen([sys.executable, "train.py", "runs/elastic", "2", address,
                               "2", str(i)], cwd=tmp_path, env=user_env(**_devices(2)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert "RESULT 2 4 2" in outs[0][0]
    assert "resum" not in outs[0][1].lower()
    for devices, until in ((2, 4), (1, STEPS)):  # stopped at `until` - 2, resumed
        proc = run_python(tmp_path, "train.py", "runs/elastic", str(until), **_devices(devices))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"RESULT 1 {devices} {until}" in proc.stdout
        assert "resum" in proc.stderr.lower()
    # The same script straight through on 1 device: in this process (one CPU device), as
    # `python train.py runs/one 6` runs it.
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["train.py", "runs/one", str(STEPS)])
    runpy.run_path("train.py", run_name="__main__")
    assert f"RESULT 1 1 {STEPS}" in capsys.readouterr().out

    runs = tmp_path / "runs"
    reference = (runs / "one" / "hashes.jsonl").read_text()
    assert len(reference.splitlines()) == STEPS
    assert (runs / "elastic" / "hashes.jsonl").read_text() == reference
    assert _evals(runs / "elastic" / "metrics.jsonl") == _evals(runs / "one" / "metrics.jsonl")
    assert _sha(runs / "elastic") == _sha(runs / "one")
    assert len(_evals(runs / "one" / "metrics.jsonl")) == STEPS // 2
    # `jtrain diff`'s library form (its command line: tests/journeys/test_forensics_journey.py)
    from jtrain.diff import diff_runs

    assert diff_runs("runs/elastic", "runs/one")["identical"] is True


def _sha(run):
    return json.loads((run / "summary.json").read_text())["state_sha256"]
