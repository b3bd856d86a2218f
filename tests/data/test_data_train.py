"""A user's torch Dataset + collate_fn + Flax NNX model trained through `jtrain.train` on 8
fake CPU devices and on 2 local processes over jax.distributed (loopback): each process
reads a disjoint shard and, per epoch, the processes together read every index exactly
once; both runs see the same global batches. Padded evaluation is exact and compiles
once."""

import json
import os
import socket
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import jtrain
from jtrain import config as config_lib
from jtrain import data as data_lib
from jtrain.losses import ROW_MASK

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N, BATCH, STEPS = 64, 16, 8  # two epochs of four global batches


class Points(torch.utils.data.Dataset):
    """Two classes in 4-d; logs (reading thread, index) so tests can see what was read."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 4, generator=g)
        self.y = (self.x[:, 0] + 0.5 * self.x[:, 1] > 0).long()
        self.log = []

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.log.append((threading.current_thread().name, int(i)))
        return self.x[i], self.y[i]


def collate(items):  # PyTorch-style: a list of (x, y) tuples -> a dict of tensors
    xs, ys = zip(*items, strict=True)
    return {"inputs": torch.stack(xs), "targets": torch.stack(ys)}


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(4, 32, rngs=rngs)
        self.out = nnx.Linear(32, 2, rngs=rngs)

    def __call__(self, x):  # [B, 4] -> [B, 2]
        return self.out(nnx.relu(self.hidden(x)))


def config(mesh_data):
    return {"total_steps": STEPS, "seed": 3,
            # device_prefetch on: training reads happen in its thread, which tells them
            # apart from the up-front checks' reads (on CPU it is off by default)
            "data": {"batch_size": BATCH, "num_threads": 0, "val_fraction": 0.0,
                     "device_prefetch": 2},
            "optim": {"lr": 3e-2, "warmup_steps": 0},
            "mesh": {"data": mesh_data}, "eval": {"every_steps": 0},
            "log": {"every_steps": 4, "writers": ["jsonl"]},
            "checkpoint": {"every_steps": 0}}


def train_reads(workdir, mesh_data):
    """Trains; returns (summary, indices the train pipeline read, in order)."""
    train = Points(N, 0)
    loader = torch.utils.data.DataLoader(train, batch_size=BATCH // jax.process_count(),
                                         shuffle=True, drop_last=True, collate_fn=collate)
    result = jtrain.train(config(mesh_data), workdir, model=MLP(nnx.Rngs(0)),
                          train_data=loader, eval_data=Points(26, 1))
    # Training reads happen in the device-prefetch thread (checks read in this one);
    # with no reader threads they come in order, so the first ones are the first epochs.
    reads = [i for thread, i in train.log if thread == "jtrain-device-prefetch"]
    return result, reads


def epochs(reads, per_epoch):
    return [reads[e * per_epoch:(e + 1) * per_epoch] for e in range(STEPS * BATCH // N)]


@pytest.mark.multidevice
def test_torch_dataset_collate_fn_and_nnx_on_8_devices(tmp_path):
    result, reads = train_reads(str(tmp_path / "run"), mesh_data=8)
    summary = result.summary
    assert summary["step"] == STEPS and np.isfinite(summary["eval/loss"])
    # The final eval ran over 26 examples in padded batches of 16: its loss is the loss
    # over the whole eval set at once.
    ev = Points(26, 1)
    logits = jtrain.to_model_fns(MLP(nnx.Rngs(0))).apply(result.state.params, ev.x.numpy())
    logits = np.asarray(logits, np.float64)
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    np.testing.assert_allclose(summary["eval/loss"], -logp[np.arange(26), ev.y.numpy()].mean(),
                               rtol=1e-6)
    for epoch in epochs(reads, N):
        assert sorted(epoch) == list(range(N))  # every index once per epoch
    assert epochs(reads, N)[0] != epochs(reads, N)[1]  # reshuffled
    with open(tmp_path / "run" / "summary.json") as f:
        assert json.load(f)["state_sha256"] == summary["state_sha256"]


def process_main():
    """One of the 2 processes (run by the test below through `python -c`)."""
    jax.distributed.initialize(coordinator_address=os.environ["JTRAIN_COORDINATOR"],
                               num_processes=int(os.environ["JTRAIN_NUM_PROCESSES"]),
                               process_id=int(os.environ["JTRAIN_PROCESS_ID"]))
    workdir = os.environ["TEST_WORKDIR"]
    result, reads = train_reads(workdir, mesh_data=2)
    with open(os.path.join(workdir, f"reads_{jax.process_index()}.json"), "w") as f:
        json.dump({"reads": reads, "summary": result.summary}, f)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_read_disjoint_shards_covering_each_epoch(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
               JTRAIN_COORDINATOR=f"127.0.0.1:{_free_port()}", JTRAIN_NUM_PROCESSES="2",
               TEST_WORKDIR=str(tmp_path),
               PYTHONPATH=os.path.dirname(os.path.abspath(__file__)))
    code = "import test_data_train as t; t.process_main()"
    procs = [subprocess.Popen(["timeout", "-k", "5", "240", sys.executable, "-c", code],
                              cwd=REPO, env={**env, "JTRAIN_PROCESS_ID": str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outs = [p.communicate()[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    got = [json.loads((tmp_path / f"reads_{i}.json").read_text()) for i in range(2)]
    per_process = [epochs(g["reads"], N // 2) for g in got]
    for e in range(STEPS * BATCH // N):
        a, b = per_process[0][e], per_process[1][e]
        assert not set(a) & set(b) and sorted(a + b) == list(range(N))
    # The global batches do not depend on the number of processes: the same run as on
    # one process on one device, up to the order of float sums.
    summary = got[0]["summary"]
    assert summary["step"] == STEPS and got[1]["summary"]["state_sha256"] == summary["state_sha256"]
    one = tmp_path / "ref"
    ref, _ = train_reads(str(one), mesh_data=1)
    np.testing.assert_allclose(summary["eval/loss"], ref.summary["eval/loss"], rtol=1e-4)


# ------------------------------------------------------------------------- padded eval
@pytest.mark.parametrize("processes", [1, 2])
def test_padded_eval_is_exact_and_compiles_once(processes):
    n, local = 37, 8  # 37 is not a multiple of the global batch
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 5)).astype(np.float32)
    y = rng.integers(0, 3, n).astype(np.int32)
    w = jnp.asarray(rng.normal(size=(5, 3)).astype(np.float32))
    traces = []

    @jax.jit
    def eval_step(batch):
        traces.append(1)
        logits = batch["inputs"] @ w  # [b, 3]
        loss = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][:, None], 1)
        hits = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32)
        m = batch[ROW_MASK]
        return {"loss": (loss[:, 0] * m).sum(), "hits": (hits * m).sum(), "n": m.sum()}

    d = config_lib.resolve({"data": {"batch_size": local * processes}}).data
    _, ev, _ = data_lib.make_sources(d, (x, y), (x, y))
    totals, counts = {"loss": 0.0, "hits": 0.0, "n": 0.0}, []
    for p in range(processes):  # each process's batches (one process plays both here)
        got = list(data_lib.eval_batches(ev, local_batch=local, process_index=p,
                                         process_count=processes))
        counts.append(len(got))
        for batch in got:
            for k, v in jax.device_get(eval_step(batch)).items():
                totals[k] += float(v)
    assert len(set(counts)) == 1 and len(traces) == 1  # same batch count; one compile
    logits = x.astype(np.float64) @ np.asarray(w, np.float64)
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    full_loss = -logp[np.arange(n), y].mean()
    assert totals["n"] == n
    np.testing.assert_allclose(totals["loss"] / n, full_loss, rtol=1e-6)
    assert totals["hits"] / n == (logits.argmax(1) == y).mean()
