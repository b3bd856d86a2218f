"""`python -m jtrain.bench data`: jtrain's data pipeline against torch's DataLoader, and
against no data at all, on one torch map-style dataset.

The dataset (`Images`) is what a torchvision pipeline does per item: a uint8 HWC image
from memory -> float32 CHW tensor, normalised, plus a random horizontal flip drawn from
torch's global RNG (jtrain seeds it per batch from (seed, epoch, batch); torch leaves it
as it is), and an int64 label. The same object, batch size and worker count go to
both sides.

(a) examples/s: `jtrain.data` (make_sources + make_train_iterator, numpy batches) vs
    `torch.utils.data.DataLoader(shuffle=True, drop_last=True)` iterated with each batch
    turned into numpy (`.numpy()`), `--batches` batches after the warm-up batches (the
    first, and two per worker: `warmup_batches`); rounds
    interleaved, alternating which side goes first, so that machine load and warm-up hit
    both alike (also for (b)). Goal >= 1.0.
(b) step time: the same jitted `jtrain` train step (a small CNN, AdamW, the batch sharded
    over all devices) fed by the real pipeline (`make_train_iterator` -> the background
    device prefetch -> `host_to_device`) vs fed one synthetic batch already on the
    devices; `--steps` steps after 3 warm-up steps, timed to `block_until_ready`, with at
    most 8 steps in flight like the training loop. Goal <= 1.03.
(c) time to first batch, each side from nothing (for jtrain: the checks, the pipeline and
    the first batch; with workers, their start-up).

Medians over rounds, the ratios of the medians (the headline) and, as a check on load
drifting between rounds on a shared machine, the median of the per-round ratios.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections import deque

import numpy as np

from jtrain.bench import machine as machine_lib

GOALS = {"examples": 1.0, "step": 1.03}


class Images:
    """A torch map-style dataset of `n` RGB images (uint8 in memory, float32 out)."""

    def __init__(self, n: int, size: int = 32, seed: int = 0):
        import torch

        rng = np.random.default_rng(seed)
        self.images = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
        self.labels = rng.integers(0, 10, n)
        self.mean = torch.tensor([0.49, 0.48, 0.45]).view(3, 1, 1)
        self.std = torch.tensor([0.25, 0.24, 0.26]).view(3, 1, 1)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        import torch

        x = torch.from_numpy(self.images[i]).permute(2, 0, 1).float().div_(255.0)
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        return (x - self.mean) / self.std, int(self.labels[i])


def _dataset_class():
    """Images as a torch Dataset subclass (torch imported only when the bench runs)."""
    import torch

    return type("Images", (Images, torch.utils.data.Dataset), {"__module__": __name__})


def make_model():
    import flax.linen as nn

    class SmallCNN(nn.Module):
        @nn.compact
        def __call__(self, x):  # [B, 3, H, W] -> [B, 10]
            x = x.transpose(0, 2, 3, 1)
            for width in (32, 64):
                x = nn.relu(nn.Conv(width, (3, 3))(x))
                x = nn.avg_pool(x, (2, 2), (2, 2))
            return nn.Dense(10)(x.reshape(x.shape[0], -1))

    return SmallCNN()


def jtrain_examples(ds, batch: int, workers: int, batches: int) -> tuple[float, float]:
    """(examples/s, time to first batch in s) through jtrain.data."""
    from jtrain import config as config_lib
    from jtrain import data as data_lib

    t0 = time.perf_counter()
    cfg = config_lib.resolve({"data": {"batch_size": batch, "num_workers": workers,
                                       "val_fraction": 0.0}})
    train, _, _ = data_lib.make_sources(cfg.data, ds)
    it = data_lib.make_train_iterator(
        train, local_batch=batch, seed=0, shuffle=True, process_index=0, process_count=1,
        num_workers=workers, prefetch=cfg.data.prefetch, num_threads=cfg.data.num_threads)
    next(it)
    ttfb = time.perf_counter() - t0
    for _ in range(warmup_batches(workers) - 1):
        next(it)
    t1 = time.perf_counter()
    for _ in range(batches):
        next(it)
    rate = batches * batch / (time.perf_counter() - t1)
    it.close()
    return rate, ttfb


def torch_examples(ds, batch: int, workers: int, batches: int) -> tuple[float, float]:
    """(examples/s, time to first batch in s) through torch's DataLoader, to numpy."""
    import torch

    t0 = time.perf_counter()
    loader = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, drop_last=True,
                                         num_workers=workers)
    it = iter(loader)

    def numpy_batch(it):
        x, y = next(it)
        return {"inputs": x.numpy(), "targets": y.numpy()}

    numpy_batch(it)
    ttfb = time.perf_counter() - t0
    for _ in range(warmup_batches(workers) - 1):
        numpy_batch(it)
    t1 = time.perf_counter()
    for _ in range(batches):
        numpy_batch(it)
    rate = batches * batch / (time.perf_counter() - t1)
    del it  # the last reference: the DataLoader's worker processes end here
    return rate, ttfb


def warmup_batches(workers: int) -> int:
    """Batches read before the timed ones, on both sides: the first, and with workers two
    per worker, so that every worker is up and the rate is the steady one (jtrain's
    workers are spawned processes, torch's forked: their start-up is in (c), not (a))."""
    return 1 + 2 * workers


class StepBench:
    """One jitted jtrain train step, fed real batches or one synthetic device batch."""

    def __init__(self, ds, batch: int, workers: int):

        from jtrain import config as config_lib, data as data_lib, mesh as mesh_lib
        from jtrain.engine.run import build

        self.cfg = cfg = config_lib.resolve({
            "total_steps": 1000, "data": {"batch_size": batch, "num_workers": workers,
                                          "val_fraction": 0.0},
            "model": {"dtype": "float32"}, "optim": {"lr": 1e-3}})
        self.ds, self.data_lib, self.mesh_lib = ds, data_lib, mesh_lib
        self.train, _, _ = data_lib.make_sources(cfg.data, ds)
        # The very set-up training uses (jtrain.engine.run.build): model, state, jitted step.
        b = build(cfg, sample=self.train[0]["inputs"], eval_example=self.train[0],
                  model=make_model())
        self.mesh, self.init, self.step = b.mesh, b.init, b.train_step

    def batches(self, real: bool):
        cfg, dl = self.cfg, self.data_lib
        host = dl.make_train_iterator(
            self.train, local_batch=cfg.data.batch_size, seed=0, shuffle=True,
            process_index=0, process_count=1, num_workers=cfg.data.num_workers,
            prefetch=cfg.data.prefetch, num_threads=cfg.data.num_threads)
        put = functools.partial(self.mesh_lib.host_to_device, mesh=self.mesh)
        if real:
            return dl.device_prefetch(host, put, cfg.data.device_prefetch)
        fixed = put(next(host))
        host.close()

        class Same:
            def __next__(self):
                return fixed

            def close(self):
                pass

        return Same()

    def ms_per_step(self, real: bool, steps: int, warmup: int = 3) -> float:
        import jax

        it, state = self.batches(real), self.init()
        for _ in range(warmup):
            state, metrics = self.step(state, next(it))
        jax.block_until_ready(metrics)
        pending: deque = deque()
        t0 = time.perf_counter()
        for _ in range(steps):
            state, metrics = self.step(state, next(it))
            pending.append(metrics)
            if len(pending) > 8:  # the loop's bounded steps in flight
                jax.block_until_ready(pending.popleft())
        jax.block_until_ready((state, metrics))
        ms = 1e3 * (time.perf_counter() - t0) / steps
        it.close()
        return ms


def run(*, n: int, batch: int, workers: int, rounds: int, batches: int, steps: int,
        progress=print) -> dict:
    import jax

    ds = _dataset_class()(n)
    bench = StepBench(ds, batch, workers)
    bench.ms_per_step(True, 2)  # compile once, outside the timed rounds
    rows, loads, info = [], [], machine_lib.machine()
    for r in range(rounds):
        first = r % 2 == 0  # alternate which side goes first (ABBA): no order bias
        with machine_lib.LoadWatch() as watch:
            if not first:
                t_rate, t_ttfb = torch_examples(ds, batch, workers, batches)
                synth = bench.ms_per_step(False, steps)
            j_rate, j_ttfb = jtrain_examples(ds, batch, workers, batches)
            real = bench.ms_per_step(True, steps)
            if first:
                t_rate, t_ttfb = torch_examples(ds, batch, workers, batches)
                synth = bench.ms_per_step(False, steps)
        loads.append(watch.record)
        rows.append({"jtrain_examples_per_sec": j_rate, "torch_examples_per_sec": t_rate,
                     "jtrain_first_batch_s": j_ttfb, "torch_first_batch_s": t_ttfb,
                     "real_ms_per_step": real, "synthetic_ms_per_step": synth})
        progress(f"round {r + 1}/{rounds}: jtrain {j_rate:,.0f} ex/s, torch {t_rate:,.0f} "
                 f"ex/s; step real {real:.2f} ms, synthetic {synth:.2f} ms")
    med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    return {
        "bench": "data", "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind, "devices": jax.device_count(),
        "num_examples": n, "batch_size": batch, "num_workers": workers, "rounds": rounds,
        "batches": batches, "steps": steps, "rows": rows, "median": med,
        "examples_ratio": med["jtrain_examples_per_sec"] / med["torch_examples_per_sec"],
        "step_ratio": med["real_ms_per_step"] / med["synthetic_ms_per_step"],
        # Per-round (paired) ratios: robust to load that drifts between rounds.
        "examples_ratio_paired": statistics.median(
            r["jtrain_examples_per_sec"] / r["torch_examples_per_sec"] for r in rows),
        "step_ratio_paired": statistics.median(
            r["real_ms_per_step"] / r["synthetic_ms_per_step"] for r in rows),
        "goals": GOALS, "machine": info, "load": loads,
        "unreliable": machine_lib.any_unreliable(loads),
    }


def format_report(res: dict) -> str:
    lines = [
        f"data: torch map-style dataset ({res['num_examples']:,} images 3x32x32 -> float32, "
        f"normalised, random flip), batch {res['batch_size']}, {res['num_workers']} worker(s), "
        f"{res['devices']} {res['backend']} device(s) ({res['device_kind']})",
        f"{'round':>5} {'jtrain ex/s':>12} {'torch ex/s':>11} {'ratio':>6} "
        f"{'jtrain 1st s':>12} {'torch 1st s':>11} {'real ms':>8} {'synth ms':>9} {'ratio':>6}",
    ]

    def row(label, r):
        return (f"{label:>5} {r['jtrain_examples_per_sec']:>12,.0f} "
                f"{r['torch_examples_per_sec']:>11,.0f} "
                f"{r['jtrain_examples_per_sec'] / r['torch_examples_per_sec']:>6.3f} "
                f"{r['jtrain_first_batch_s']:>12.3f} {r['torch_first_batch_s']:>11.3f} "
                f"{r['real_ms_per_step']:>8.2f} {r['synthetic_ms_per_step']:>9.2f} "
                f"{r['real_ms_per_step'] / r['synthetic_ms_per_step']:>6.3f}")

    lines += [row(f"{machine_lib.mark(ld)}{i + 1}", r)
              for i, (r, ld) in enumerate(zip(res["rows"], res["load"], strict=True))]
    lines.append(row("med", res["median"]))
    lines.append(f"per-round ratios, median: examples/s {res['examples_ratio_paired']:.3f}, "
                 f"step time {res['step_ratio_paired']:.3f}")
    lines += [machine_lib.loads_line(res["load"]), machine_lib.header_line(res["machine"])]
    m = res["median"]
    lines += [
        f"(a) examples/s: jtrain {m['jtrain_examples_per_sec']:,.0f}, torch DataLoader "
        f"{m['torch_examples_per_sec']:,.0f}, ratio {res['examples_ratio']:.3f} "
        f"(goal >= {GOALS['examples']})",
        f"(b) step time: real data {m['real_ms_per_step']:.2f} ms, synthetic on-device batch "
        f"{m['synthetic_ms_per_step']:.2f} ms, ratio {res['step_ratio']:.3f} "
        f"(goal <= {GOALS['step']})",
        f"(c) time to first batch: jtrain {m['jtrain_first_batch_s']:.3f} s (checks "
        f"included), torch {m['torch_first_batch_s']:.3f} s",
    ]
    return "\n".join(lines)
