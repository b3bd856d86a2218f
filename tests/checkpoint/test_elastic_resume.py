"""Elastic resume as a user does it: the same command on 4 (fake CPU) devices, then on 2
(2 processes of 1 device each), then on 1, each resuming the previous checkpoint. The params
reshard onto the new mesh and the data order goes on: the global example indices the train steps
see, in order, are those of the uninterrupted 4-device run (none skipped or repeated), and the final
loss agrees within float tolerance (the reduction order differs across topologies)."""

import json
import socket
import subprocess
import sys

from journey import run_python, user_env

SCRIPT = '''
import sys
import jax
import jax.numpy as jnp
import numpy as np
import flax.linen as nn
import jtrain
from jtrain.losses import ROW_MASK

# WORKDIR:TOTAL[,WORKDIR:TOTAL...]: the runs one after another, in this process.
runs = [(w, int(t)) for w, t in (r.split(":") for r in sys.argv[1].split(","))]
if len(sys.argv) > 2:  # address, number of processes, this process's id
    jax.distributed.initialize(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))


class Windows:  # a map-style dataset: example i knows its index
    def __len__(self):
        return 200

    def __getitem__(self, i):
        x = (np.arange(17) * (i % 7 + 1) + i) % 32
        return {"inputs": x[:-1].astype(np.int32), "targets": x[1:].astype(np.int32),
                "idx": np.int32(i)}


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Embed(32, 16)(x)
        return nn.Dense(32)(nn.gelu(nn.Dense(32)(h)))


def run(workdir, total):
    def log_indices(idx):
        with open(workdir + ".seen", "a") as f:
            f.write(" ".join(map(str, np.asarray(idx).tolist())) + "\\n")

    def loss_fn(outputs, batch):
        if ROW_MASK not in batch:  # training batches (eval ones carry a row mask)
            jax.debug.callback(log_indices, batch["idx"])
        logp = jax.nn.log_softmax(outputs.astype(jnp.float32))
        nll = -jnp.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
        return nll.sum(), jnp.asarray(nll.size, jnp.float32)

    c = jtrain.defaults()
    c.total_steps = total
    c.data.update(batch_size=8, model_inputs=("inputs",))
    c.optim.update(lr=1e-2, warmup_steps=1, decay_steps=60)
    c.eval.update(every_steps=0, num_batches=1)
    c.log.update(every_steps=5, writers=("jsonl",))
    c.checkpoint.update(every_steps=5, allow_changes=("total_steps",))
    c.compile.cache_dir = "auto"  # the shared persistent cache (warm after a first run)
    r = jtrain.train(c, workdir, model=Model(), train_data=Windows(), loss_fn=loss_fn)
    print("RESULT", workdir, jax.device_count(), r.summary["resumed_from"],
          r.summary["train/loss"] if "train/loss" in r.summary
          else r.train_history[-1]["train/loss"])


for workdir, total in runs:
    run(workdir, total)
'''


def _results(stdout) -> dict:
    """{workdir: [device count, resumed from, final loss]} of each run a process did."""
    lines = [line.split()[1:] for line in stdout.splitlines() if line.startswith("RESULT ")]
    return {w: rest for w, *rest in lines}


def _phase(cwd, runs, devices):
    p = run_python(cwd, "elastic.py", runs,
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    assert p.returncode == 0, p.stderr[-3000:]
    return _results(p.stdout)


def _seen(cwd, workdir):  # the train batches (set-up checks call the loss on 1 example)
    lines = (cwd / f"{workdir}.seen").read_text().splitlines()
    return [line.split() for line in lines if len(line.split()) == 8]


def _two_processes(cwd, workdir, total):
    """`total` steps as 2 processes x 1 device over loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    env = user_env(XLA_FLAGS="--xla_force_host_platform_device_count=1")
    procs = [subprocess.Popen([sys.executable, "elastic.py", f"{workdir}:{total}", address,
                               "2", str(i)], cwd=cwd, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    return _results(outs[0][0])[workdir]


def _loss_at(cwd, workdir, step):
    for line in (cwd / workdir / "metrics.jsonl").open():
        m = json.loads(line)
        if m["step"] == step and "train/loss" in m:
            return m["train/loss"]


def test_resume_on_4_then_2_then_1_devices_continues_the_data_order(tmp_path):
    (tmp_path / "elastic.py").write_text(SCRIPT)
    # One 4-device process: the reference (60 steps x 8: 2.6 epochs), then the first 20
    # steps of the elastic run (its own workdir, a fresh start).
    first = _phase(tmp_path, "ref:60,el:20", 4)
    reference = first["ref"]
    assert reference[:2] == ["4", "None"]
    assert first["el"][:2] == ["4", "None"]
    # 1 process x 4 devices -> 2 processes x 1 device -> 1 process x 1 device.
    assert _two_processes(tmp_path, "el", 40)[:2] == ["2", "20"]
    last = _phase(tmp_path, "el:60", 1)["el"]
    assert last[:2] == ["1", "40"]
    ref, el = _seen(tmp_path, "ref"), _seen(tmp_path, "el")
    assert len(ref) == 60
    assert el == ref  # the same global examples, in the same order, none twice
    # 190 train examples (5 % held out for eval), 23 full batches per epoch: within an
    # epoch no example comes twice.
    for epoch in (ref[:23], ref[23:46]):
        flat = [i for b in epoch for i in b]
        assert len(set(flat)) == len(flat) == 184
    assert abs(_loss_at(tmp_path, "el", 40) - _loss_at(tmp_path, "ref", 40)) < 1e-4
    assert abs(float(last[2]) - float(reference[2])) < 1e-4
    metrics = [json.loads(line) for line in (tmp_path / "el" / "metrics.jsonl").open()]
    assert [m["step"] for m in metrics if "train/loss" in m] == list(range(5, 61, 5))
