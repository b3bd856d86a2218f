"""The two sides of `python -m jtrain.bench overhead`: the real jtrain loop and a
hand-written minimal `jax.jit` loop, on the same model, optimizer, init and batches.

jtrain: `jtrain.train(config, workdir)` runs `log_every + steps` steps in a fresh
workdir (eval and checkpoint only at the end, every other setting as the preset has it).
Its time comes from `metrics.jsonl`'s `time` stamps, taken after the loop fetched a
logged step's metrics: the first interval (compilation) is dropped, the rest is the
steady time over `steps` steps; setup, compilation and the final eval and save are the
run's fixed cost. (`perf/steps_per_sec` stamps steps at dispatch and reads too fast over
intervals shorter than `max_steps_in_flight`: not used.)

hand: the same model, optimizer, iterator and initial parameters, a textbook step
(`value_and_grad` -> `tx.update` -> `apply_updates`) under `jax.jit(donate_argnums=0)`,
the same `log_every` warm-up steps, then `steps` steps timed with `perf_counter` up to
`block_until_ready`, fetching the loss every `log_every` steps (one step late).

The headline is the ratio of the medians over rounds; the 10th and 50th percentile of
all intervals (pooled) show the quiet stretches of a loaded machine. Equal final losses
show both sides did the same work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

from jtrain import config as config_lib
from jtrain import data as data_lib
from jtrain.bench import machine as machine_lib
from jtrain import models as models_lib
from jtrain import optim as optim_lib
from jtrain import precision as precision_lib
from jtrain.observe import layout
from jtrain.engine.run import train as jtrain_train  # `jtrain.train` itself is this function

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
BASE_CONFIG = CONFIGS / "base.py"

# Defaults per preset: (steps timed per round, log interval = warm-up steps, rounds).
# Base runs ~0.3-0.5 s/step on 2 quiet CPU cores (+~10-25 s fixed cost per jtrain round):
# 16 steps a side (longer than the machine's load bursts of a few seconds), 4 rounds (each
# side first twice, side_order); the whole default run stays under ~4 min.
PRESETS = {
    "base": dict(steps=16, log_every=4, rounds=4),
    "tiny": dict(steps=2000, log_every=100, rounds=5),
    # configs/gpt2_small.py: the GPU throughput run (124 M params, 32 x 1024 tokens per step)
    "gpt2": dict(steps=60, log_every=20, rounds=3),
    "gpt2_debug": dict(steps=4, log_every=2, rounds=1),  # its :debug variant, for CPUs
}

# Dense bf16 peak FLOP/s per device (no sparsity), matched against jax's device_kind.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12}


class BenchError(ValueError):
    """A bad bench argument or a missing file; printed as one line, exit 2."""


def load_base_config(path: Path = BASE_CONFIG, variant: str | None = None):
    if not path.is_file():
        raise BenchError(f"{path}: not found (the presets read the repository's configs/)")
    spec = importlib.util.spec_from_file_location(f"jtrain_bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(variant)


def preset_config(name: str):
    """The preset's config before the bench's run-length overrides."""
    if name == "base":
        return load_base_config()
    if name == "tiny":  # dispatch-bound: ~1 ms of compute per step on a CPU core
        cfg = load_base_config()
        cfg.model.update(d_model=32, num_layers=1, num_heads=2, d_ff=64, max_len=32)
        cfg.data.update(seq_len=32, batch_size=8)
        return cfg
    if name in ("gpt2", "gpt2_debug"):
        return load_base_config(CONFIGS / "gpt2_small.py",
                                "debug" if name == "gpt2_debug" else None)
    raise BenchError(f"--model: unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")


def bench_config(name: str, steps: int, log_every: int):
    """Resolved config: `log_every + steps` steps, eval and checkpoint only at the end."""
    cfg = preset_config(name)
    cfg.total_steps = log_every + steps
    cfg.log.every_steps = log_every
    cfg.eval.every_steps = 0
    cfg.eval.num_batches = 1  # the final eval is outside the timed window; keep it short
    cfg.checkpoint.every_steps = 0
    if "every_seconds" in cfg.checkpoint:  # no time-based saves inside the window either
        cfg.checkpoint.every_seconds = 0.0
    cfg.optim.warmup_steps = min(cfg.optim.warmup_steps, cfg.total_steps // 2)
    return config_lib.resolve(cfg)


# ---------------------------------------------------------------------------- jtrain side
@dataclasses.dataclass
class Sample:
    ms_per_step: float
    final_loss: float
    wall_s: float = float("nan")  # whole train() call (jtrain) / warm-up + timed (hand)
    fixed_s: float = float("nan")  # jtrain: wall - steady (setup, compile, eval, ckpt)
    intervals_ms: list = dataclasses.field(default_factory=list)
    load: dict = dataclasses.field(default_factory=dict)  # machine.load_record of the run


def run_jtrain(cfg, workroot: str, round_index: int, keep: bool) -> Sample:
    workdir = os.path.join(workroot, f"jtrain_round{round_index}")
    shutil.rmtree(workdir, ignore_errors=True)  # a fresh start, never a resume
    os.makedirs(workdir)
    console = io.StringIO()
    with contextlib.redirect_stderr(console):  # the progress lines
        t0 = time.perf_counter()
        jtrain_train(cfg, workdir)
        wall = time.perf_counter() - t0
    layout.write_file(os.path.join(workdir, "console.log"), console.getvalue())
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        logs = [r for r in map(json.loads, f) if "perf/steps_per_sec" in r]
    if not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return jtrain_sample(logs, cfg.log.every_steps, cfg.total_steps, wall)


def jtrain_sample(logs: list[dict], log_every: int, total: int, wall: float) -> Sample:
    """Steady-state time from the loop's log records (the first interval dropped)."""
    first = next((r for r in logs if r["step"] == log_every), None)
    last = next((r for r in logs if r["step"] == total), None)
    if first is None or last is None or total <= log_every:
        raise RuntimeError(f"metrics.jsonl lacks the log records at steps {log_every} and "
                           f"{total}: got steps {[r['step'] for r in logs]}")
    steady = [r for r in logs if r["step"] > log_every]
    steady_s = last["time"] - first["time"]
    steps = total - log_every
    intervals = [1e3 * (b["time"] - a["time"]) / (b["step"] - a["step"])
                 for a, b in zip([first] + steady[:-1], steady, strict=True)]
    return Sample(ms_per_step=1e3 * steady_s / steps, final_loss=float(last["train/loss"]),
                  wall_s=wall, fixed_s=wall - steady_s, intervals_ms=intervals)


# ------------------------------------------------------------------------------ hand side
def iterator_kwargs(cfg) -> dict:
    """The arguments jtrain.train passes to make_train_iterator (RunData.train_iterator),
    one process."""
    d = cfg.data
    return dict(local_batch=d.batch_size, seed=cfg.seed, shuffle=d.shuffle, process_index=0,
                process_count=1, num_workers=d.num_workers, drop_last=d.drop_last,
                prefetch=d.prefetch, num_threads=d.num_threads)


class HandLoop:
    """The minimal loop, built once (one compile); each round restarts from init."""

    def __init__(self, cfg):
        self.cfg = cfg
        policy = precision_lib.make_policy(cfg.model)
        model = models_lib.make_model(cfg.model, dtype=policy.compute_dtype,
                                      param_dtype=policy.param_dtype)
        tx, _ = optim_lib.make_optimizer(cfg.optim, cfg.total_steps)
        self.source, _, _ = data_lib.make_sources(cfg.data)
        sample = np.asarray(self.source[0]["inputs"])
        x = jnp.zeros((1,) + sample.shape, sample.dtype)
        key = jax.random.fold_in(jax.random.key(cfg.seed), 0)  # jtrain's init key
        self._init_params = jax.jit(
            lambda: nn.unbox(model.init({"params": key, "dropout": key}, x)["params"]))
        self._tx = tx

        def loss_fn(params, batch):
            logits = model.apply({"params": params}, batch["inputs"], train=True)
            return optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), batch["targets"]).mean()

        def step(state, batch):
            params, opt_state = state
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        self.step = jax.jit(step, donate_argnums=0)
        self._iter_kwargs = iterator_kwargs(cfg)

    def iterator(self):
        """The training batches, as jtrain.train would read them (one process)."""
        return data_lib.make_train_iterator(self.source, **self._iter_kwargs)

    def init_state(self):
        """(params, optimizer state) from jtrain's init key: the state every run starts at."""
        params = self._init_params()
        return params, self._tx.init(params)

    def run(self, steps: int, log_every: int) -> Sample:
        """Times `steps` steps after `log_every` warm-up steps. Like a loop that prints
        its loss every `log_every` steps, it stamps each interval (per-interval view)."""
        it, step, t0 = self.iterator(), self.step, time.perf_counter()
        state = self.init_state()
        for _ in range(log_every):
            state, loss = step(state, jax.device_put(next(it)))
        jax.block_until_ready(state)
        t1 = time.perf_counter()
        marks, logged = [(0, t1)], None
        for i in range(1, steps + 1):
            state, loss = step(state, jax.device_put(next(it)))
            if logged is not None:  # fetch the logged loss one step late: no bubble
                float(logged[1])
                marks.append((logged[0], time.perf_counter()))
                logged = None
            if i % log_every == 0 and i < steps:
                logged = (i, loss)
        jax.block_until_ready((state, loss))
        t2 = time.perf_counter()
        marks.append((steps, t2))
        if hasattr(it, "close"):
            it.close()
        # neighbouring marks: one interval fewer than marks
        intervals = [1e3 * (tb - ta) / (sb - sa)
                     for (sa, ta), (sb, tb) in zip(marks, marks[1:], strict=False)]
        return Sample(ms_per_step=1e3 * (t2 - t1) / steps, final_loss=float(loss),
                      wall_s=t2 - t0, intervals_ms=intervals)


# ------------------------------------------------------------------------------ the bench
def throughput(cfg, ms_per_step: float) -> dict:
    """tokens/s, and MFU on a GPU with a known peak (None elsewhere)."""
    per_s = 1e3 / ms_per_step
    tokens = cfg.data.batch_size * cfg.data.seq_len * per_s
    out = {"tokens_per_sec": tokens, "mfu": None, "mfu_note": ""}
    backend = jax.default_backend()
    if backend != "gpu":
        out["mfu_note"] = f"n/a on {backend}"
        return out
    kind = jax.devices()[0].device_kind
    peak = next((v for k, v in PEAK_FLOPS.items() if k in kind), None)
    flops = models_lib.flops_per_example(cfg.model, (cfg.data.seq_len,))
    if peak is None or flops is None:
        out["mfu_note"] = f"n/a (no peak FLOP/s known for {kind!r})"
        return out
    out["mfu"] = flops * cfg.data.batch_size * per_s / (peak * jax.device_count())
    from jtrain.models import transformer  # the only family with a preset here

    n = transformer.matmul_params(cfg.model)
    out["mfu_note"] = (f"(6N + 12*L*d*T FLOPs per token, N = {n:,} matmul params; peak "
                       f"{peak / 1e12:.0f} TFLOP/s dense bf16, {kind})")
    return out


def side_summary(samples: list[Sample], cfg) -> dict:
    ms = [s.ms_per_step for s in samples]
    med = statistics.median(ms)
    pooled = sorted(x for s in samples for x in s.intervals_ms)
    out = {"ms_per_step": ms, "median_ms": med, "min_ms": min(ms), "max_ms": max(ms),
           "final_loss": [s.final_loss for s in samples],
           "wall_s": [s.wall_s for s in samples],
           "load": [s.load for s in samples],
           "unreliable": machine_lib.any_unreliable(s.load for s in samples),
           "intervals_ms": [s.intervals_ms for s in samples],
           "interval_p10_ms": float(np.percentile(pooled, 10)) if pooled else float("nan"),
           "interval_p50_ms": float(np.percentile(pooled, 50)) if pooled else float("nan"),
           **throughput(cfg, med)}
    if samples and math.isfinite(samples[0].fixed_s):  # jtrain only
        out["fixed_s"] = [s.fixed_s for s in samples]
    return out


def side_order(round_index: int) -> tuple[str, str]:
    """Which side runs first in a round: jtrain in even rounds, the hand loop in odd ones,
    so that neither side always follows the other (a drift in the machine's load, or
    what the previous side left behind, falls on both alike)."""
    return ("jtrain", "hand") if round_index % 2 == 0 else ("hand", "jtrain")


def run_overhead(model: str, *, rounds: int, steps: int, log_every: int, workdir: str | None,
                 progress=print) -> dict:
    """Interleaved rounds (jtrain then hand, hand then jtrain, ...: `side_order`);
    returns the result dict."""
    if rounds < 1 or steps < 1 or log_every < 1:
        raise BenchError("--rounds, --steps and --log_every must be >= 1")
    if jax.device_count() != 1:  # jtrain would use them all, the hand loop one
        raise BenchError(f"overhead compares one device; found {jax.device_count()} "
                         "(set CUDA_VISIBLE_DEVICES=0 or drop the fake CPU device count)")
    cfg = bench_config(model, steps, log_every)
    root = workdir or tempfile.mkdtemp(prefix="jtrain_bench_")
    info = machine_lib.machine()
    try:
        hand = HandLoop(cfg)
        jt, hd = [], []
        sides = {"jtrain": (jt, lambda r: run_jtrain(cfg, root, r, keep=workdir is not None)),
                 "hand": (hd, lambda r: hand.run(steps, log_every))}
        for r in range(rounds):
            for name in side_order(r):
                samples, run = sides[name]
                with machine_lib.LoadWatch() as watch:
                    samples.append(run(r))
                samples[-1].load = watch.record
            progress(f"round {r + 1}/{rounds}: jtrain {jt[-1].ms_per_step:.3f} ms/step, "
                     f"hand {hd[-1].ms_per_step:.3f} ms/step")
    finally:
        if workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    j, h = side_summary(jt, cfg), side_summary(hd, cfg)
    paired = [a.ms_per_step / b.ms_per_step for a, b in zip(jt, hd, strict=True)]
    return {
        "bench": "overhead", "model": model, "goal": GOALS[model], "machine": info,
        "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
        "rounds": rounds, "steps": steps, "log_every": log_every,
        "batch_size": cfg.data.batch_size, "seq_len": cfg.data.seq_len,
        "model_config": cfg.model.to_dict(),
        "jtrain": j, "hand": h,
        "ratio": j["median_ms"] / h["median_ms"],
        "paired_ratios": paired,
        "unreliable": j["unreliable"] or h["unreliable"],
        "interval_p10_ratio": j["interval_p10_ms"] / h["interval_p10_ms"],
        "interval_p50_ratio": j["interval_p50_ms"] / h["interval_p50_ms"],
    }


GOALS = {"base": 1.02, "tiny": 1.10, "gpt2": 1.02, "gpt2_debug": 1.10}
