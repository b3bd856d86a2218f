"""Checkpoints outlive upgrades: tests/fixtures/run_v1/ is a run written by checkpoint
format 1 (docs/checkpoint-format.md): a user's NNX model (tests/projects/nnx_mlp.py) with
the weight EMA on, stopped after its checkpoint at step 2 of 4. This release must read that
checkpoint bitwise (the hash of every saved leaf, no computation involved) and resume it to
step 4 with the final state hash recorded for this CPU class. Those two steps are float
computation that XLA:CPU compiles for the CPU it runs on: a CPU with AVX-512 and one with
AVX2 only give other bits, even with XLA's instruction set capped at AVX2 (`ISA`, kept
so each class has one result); the record holds one hash per class
(docs/checkpoint-format.md).

Regenerate (only together with a changelog entry):

    python tests/checkpoint/test_checkpoint_format.py --regenerate
"""

import hashlib
import json
import os
import shutil
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "..", "fixtures", "run_v1")
RECORD = os.path.join(HERE, "..", "fixtures", "run_v1.json")
PROJECTS = os.path.join(HERE, "..", "projects")
CONFIG = {"model": {"name": "user", "factory": "nnx_mlp:make"},
          "data": {"source": "nnx_mlp:data", "kwargs": {"n": 64}, "batch_size": 16},
          "total_steps": 4, "seed": 3, "optim": {"lr": 0.05, "ema": {"decay": 0.5}},
          "eval": {"every_steps": 0}, "checkpoint": {"every_steps": 2},
          "log": {"writers": ["jsonl"], "verbosity": 0, "every_steps": 1}}
# The resume's float steps are compiled for this instruction set on every machine.
ISA = "--xla_cpu_max_isa=AVX2"
RESUME = """
import json

import jtrain

config = json.load(open("run/config.json"))  # the run's own config feeds back
result = jtrain.train(config, "run")
print(json.dumps({"step": result.summary["step"], "sha": result.summary["state_sha256"],
                  "steps": [r["step"] for r in result.train_history]}))
"""
FIELDS = ("step", "params", "opt_state", "rng", "loss_scale", "skipped_steps",
          "consecutive_skips", "halted_at", "lr_factor", "ema", "model_state")


def saved_sha256(step_dir: str) -> str:
    """SHA-256 over every leaf a checkpoint holds (names, dtypes, shapes, bytes, in name
    order), read as saved: integer leaves (step, rng, counters) included."""
    from jtrain.checkpoint import export as export_lib

    digest = hashlib.sha256()
    leaves = export_lib.load_checkpoint_leaves(step_dir, FIELDS)
    for name in sorted(leaves):
        arr = np.ascontiguousarray(leaves[name])
        digest.update(f"{name}{arr.dtype.name}{arr.shape}".encode())
        digest.update(arr.tobytes())
    return digest.hexdigest()


def _in(root, monkeypatch=None):
    """The user's directory: nnx_mlp.py beside the run, on sys.path, the cwd."""
    shutil.copy(os.path.join(PROJECTS, "nnx_mlp.py"), root)
    if monkeypatch is not None:
        monkeypatch.syspath_prepend(str(root))
        monkeypatch.chdir(root)
    else:
        sys.path.insert(0, str(root))
        os.chdir(root)


def regenerate() -> None:
    """Trains the fixture's run to step 4, records the hashes, then leaves it as a run
    stopped after its step-2 checkpoint (step 4's checkpoint and summary removed)."""
    import tempfile

    import jtrain

    with tempfile.TemporaryDirectory() as tmp:
        _in(tmp)
        jtrain.train(CONFIG, "run")
        run = os.path.join(tmp, "run")
        shutil.rmtree(os.path.join(run, "checkpoints", "4"))
        os.remove(os.path.join(run, "summary.json"))
        for name in os.listdir(run):  # the log and signature are this machine's
            if name not in ("config.json", "run.json", "metrics.jsonl", "checkpoints"):
                path = os.path.join(run, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        shutil.rmtree(FIXTURE, ignore_errors=True)
        shutil.copytree(run, FIXTURE)
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(FIXTURE, os.path.join(tmp, "run"))
        resumed = resume(tmp)
    record = {"format": 1, "step": 2, "final_step": 4,
              "saved_sha256": saved_sha256(os.path.join(FIXTURE, "checkpoints", "2")),
              "final_state_sha256": {**json.load(open(RECORD))["final_state_sha256"],
                                     cpu_class(): resumed["sha"]},
              "made_with": {"jtrain": jtrain.__version__, "machine": "x86_64 CPU",
                            "xla_flags": ISA}}
    with open(RECORD, "w") as f:
        f.write(json.dumps(record, indent=2, sort_keys=True) + "\n")


def resume(root) -> dict:
    """The run at ROOT/run resumed to its end by a user's script in ROOT, compiled for
    the `ISA` cap (a new process: XLA reads its flags when its CPU backend starts)."""
    import subprocess

    shutil.copy(os.path.join(PROJECTS, "nnx_mlp.py"), root)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    proc = subprocess.run([sys.executable, "-c", RESUME], cwd=root, capture_output=True,
                          text=True, timeout=300, env={**env, "XLA_FLAGS": ISA})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_format_1_checkpoint_reads_bitwise_and_resumes_to_the_recorded_state(tmp_path):
    record = json.load(open(RECORD))
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    assert sorted(os.listdir(run / "checkpoints")) == ["2"]
    assert saved_sha256(str(run / "checkpoints" / "2")) == record["saved_sha256"]
    resumed = resume(tmp_path)
    assert resumed["step"] == record["final_step"] == 4
    assert resumed["steps"] == [3, 4]  # resumed after step 2
    hashes = record["final_state_sha256"]
    assert cpu_class() in hashes, (f"no recorded hash for CPU class {cpu_class()}: this "
                                   f"machine resumed to {resumed['sha']}")
    assert resumed["sha"] == hashes[cpu_class()]


def cpu_class() -> str:
    """The x86-64 class the resume's float steps compile differently for."""
    with open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith("flags")), "").split()
    return "avx512f" if "avx512f" in flags else "avx2" if "avx2" in flags else "other"


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit("usage: python tests/checkpoint/test_checkpoint_format.py --regenerate")
    regenerate()
