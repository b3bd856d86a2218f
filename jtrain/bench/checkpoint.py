"""`python -m jtrain.bench checkpoint`: what checkpointing costs a training loop.

A ~100 M-parameter MLP (1024 -> 4096 x 7 -> 16; `--params` scales the depth) with AdamW state
(~1.3 GB of arrays), the real train step (jitted, donating its state) and the real
`jtrain.checkpoint` Checkpointer (orbax async save + our manifest of CRC-32s, preservation
policy, integrity checks on restore). Per round:

  baseline   `--steps` train steps without a save: steps/s (each step blocked on);
  async      `save()` then train steps until the background write (and manifest) is
             done: the time `save()` blocked the loop, the total save time (call to
             finished), and steps/s while the write ran;
  sync       `save()` + `wait()`: the time a synchronous save blocks the loop;
  restore    a fresh Checkpointer picks the newest step, checks every file's CRC and
             restores into the sharded abstract state (what a restart does).

Reported: medians over `--rounds` of blocked(async) / blocked(sync) (goal <= 0.25),
total save and restore seconds (goal <= 5 s each), and steps/s during a save / without
(goal >= 0.95). A first, unmeasured save warms orbax up. The restored state's
state_sha256 is checked against the saved one once.

On a CPU-only machine the train step and the background write compete for the same
cores: `--writer_nice` (JTRAIN_WRITER_NICE, default 19) trades the two goals. At 19
the write takes only cycles the step leaves idle (steps/s ~unchanged, the write takes
longer); at 0 it finishes sooner and slows the steps. The sync time is what the write
costs when nothing competes (after a stop, or with the work on a GPU).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import threading
import time

import jax
import numpy as np

from jtrain import checkpoint
from jtrain import config as config_lib
from jtrain import mesh as mesh_lib
from jtrain import state as state_lib
from jtrain.checkpoint import policy
from jtrain.engine.run import build

IN_FEATURES, WIDTH, OUTPUTS, BATCH = 1024, 4096, 16, 8
GOALS = {"block_ratio": 0.25, "save_s": 5.0, "restore_s": 5.0, "steps_ratio": 0.95}


def _config(params: float):
    width = WIDTH if params >= 20e6 else 256  # small sizes: smoke tests
    layers = max(1, round((params - IN_FEATURES * width) / (width * width)) + 1)
    return config_lib.resolve({
        "total_steps": 10**6, "data": {"batch_size": BATCH},
        "model": {"name": "mlp", "hidden": (width,) * layers, "num_outputs": OUTPUTS,
                  "dtype": "float32"},
        "optim": {"name": "adamw", "lr": 1e-4, "weight_decay": 0.01, "warmup_steps": 0},
        "checkpoint": {"every_steps": 0, "max_to_keep": 1, "keep_top_k": 0}})


def run_checkpoint_bench(params: float = 100e6, rounds: int = 3, steps: int = 8,
                         writer_nice: int = 19, workdir: str | None = None,
                         progress=print) -> dict:
    cfg = _config(params)
    os.environ[policy.WRITER_NICE_ENV] = str(writer_nice)  # read by each Checkpointer
    # The very set-up training uses (jtrain.engine.run.build): model, state, jitted step.
    b = build(cfg, sample=np.zeros((IN_FEATURES,), np.float32),
              eval_example={"targets": np.int32(0)})
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(b.abstract.params))
    n_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(b.abstract))
    state, train_step = b.init(), b.train_step
    batch_sharding = mesh_lib.batch_sharding(b.mesh)
    rng = np.random.default_rng(0)
    batch = jax.device_put({
        "inputs": rng.normal(size=(BATCH, IN_FEATURES)).astype(np.float32),
        "targets": rng.integers(0, OUTPUTS, BATCH).astype(np.int32)}, batch_sharding)

    def one_step(s):
        s, m = train_step(s, batch)
        jax.block_until_ready(m["train/loss"])
        return s

    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="jtrain-bench-ckpt-")
    try:
        progress(f"bench checkpoint: {n_params / 1e6:.1f} M params, "
                 f"{n_bytes / 2**30:.2f} GiB of state, {jax.device_count()} "
                 f"{jax.default_backend()} device(s); compiling...")
        for _ in range(2):
            state = one_step(state)
        ck = checkpoint.Checkpointer(workdir, cfg)
        ck.restore_or_init(b.abstract_with_shardings(),
                           lambda: None)
        step = int(state.step)
        ck.save(step, state, {})  # warm-up save (orbax compiles its copies once)
        ck.wait()
        rows = []
        for r in range(rounds):
            row = {}
            t = time.perf_counter()
            for _ in range(steps):
                state = one_step(state)
            row["steps_per_s_base"] = steps / (time.perf_counter() - t)

            step = int(state.step)
            t0 = time.perf_counter()
            ck.save(step, state, {})
            row["block_async_s"] = time.perf_counter() - t0
            done = {}
            waiter = threading.Thread(target=lambda ck=ck, done=done: (
                ck.wait(), done.setdefault("t", time.perf_counter())))
            waiter.start()
            n, t1 = 0, time.perf_counter()
            while "t" not in done:
                state = one_step(state)
                n += 1
            t2 = time.perf_counter()
            waiter.join()
            row["save_total_s"] = done["t"] - t0
            row["steps_during_save"] = n
            row["steps_per_s_during"] = n / (t2 - t1) if n else float("nan")

            state = one_step(state)
            step = int(state.step)
            t0 = time.perf_counter()
            ck.save(step, state, {})
            ck.wait()
            row["block_sync_s"] = time.perf_counter() - t0

            want = state_lib.state_sha256(state) if r == 0 else None
            ck.close()
            t0 = time.perf_counter()
            ck = checkpoint.Checkpointer(workdir, cfg)
            start = ck.restore_or_init(
                b.abstract_with_shardings(), lambda: None)
            jax.block_until_ready(start.state)
            row["restore_s"] = time.perf_counter() - t0
            if want is not None and state_lib.state_sha256(start.state) != want:
                raise RuntimeError("restored state differs from the saved one")
            del start
            rows.append(row)
            progress(f"round {r + 1}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()))
        ck.close()
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)

    med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    return {
        "params": n_params, "state_bytes": n_bytes, "rounds": rows, "median": med,
        "writer_nice": writer_nice,
        "steps": steps, "backend": jax.default_backend(), "devices": jax.device_count(),
        "block_ratio": med["block_async_s"] / med["block_sync_s"],
        "steps_ratio": med["steps_per_s_during"] / med["steps_per_s_base"],
        "goals": GOALS,
    }


def format_report(res: dict) -> str:
    m, g = res["median"], res["goals"]

    def mark(ok):
        return "ok" if ok else "MISSED"

    lines = [
        f"checkpoint: {res['params'] / 1e6:.1f} M params + AdamW, "
        f"{res['state_bytes'] / 2**30:.2f} GiB per checkpoint, {res['devices']} "
        f"{res['backend']} device(s), writer nice {res['writer_nice']}, "
        f"{len(res['rounds'])} rounds (medians)",
        f"  loop blocked by a save: async {m['block_async_s'] * 1e3:.0f} ms, sync "
        f"{m['block_sync_s']:.2f} s: ratio {res['block_ratio']:.3f} "
        f"(goal <= {g['block_ratio']}) {mark(res['block_ratio'] <= g['block_ratio'])}",
        f"  total async save (call to manifest written): {m['save_total_s']:.2f} s "
        f"(goal <= {g['save_s']:g} s) {mark(m['save_total_s'] <= g['save_s'])}",
        f"  restore (integrity check + orbax restore): {m['restore_s']:.2f} s "
        f"(goal <= {g['restore_s']:g} s) {mark(m['restore_s'] <= g['restore_s'])}",
        f"  steps/s during a save {m['steps_per_s_during']:.2f} vs without "
        f"{m['steps_per_s_base']:.2f}: ratio {res['steps_ratio']:.3f} "
        f"(goal >= {g['steps_ratio']}) {mark(res['steps_ratio'] >= g['steps_ratio'])}",
    ]
    return "\n".join(lines)
