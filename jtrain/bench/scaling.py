"""`python -m jtrain.bench scaling`: examples/s per device at 1, 2, 4, 8 devices for
data parallel, FSDP and tensor parallel, and the time to first step of a cold and a warm
compile cache against a hand-written `jax.jit` loop's.

Each device count runs in its own process (fake CPU devices must be set before JAX
starts): `jtrain.train` for each strategy (mesh.data=n, mesh.fsdp=n, mesh.tensor=n) on
the same model and global batch, `2 * steps` steps logged every `steps`; the rate is the
summary's `perf/examples_per_sec` (the second interval, compilation excluded) divided by
n. On fake CPU devices all "devices" share the same cores, so this measures what
sharding costs (collectives, partitioned programs), not a speed-up: ideal is a flat
examples/s in total, i.e. per-device figures falling as 1/n.

Time to first step: three fresh processes, each timed from before its first import of
jax to its first step's result: the hand-written loop (jtrain.bench.overhead.HandLoop:
jit(init), jit(step), the same data), then jtrain with an empty compile cache (cold),
then jtrain again on that cache (warm); jtrain's own breakdown (observe.startup) is
printed for both. Goals: jtrain cold <= 1.5x the hand loop, warm <= 0.5x cold.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

STRATEGIES = ("data", "fsdp", "tensor")
PRESETS = {  # heads divisible by 8 so that tensor=8 shards every attention weight
    "small": dict(model=dict(d_model=64, num_layers=2, num_heads=8, d_ff=256, max_len=64),
                  data=dict(seq_len=64, batch_size=32)),
    "tiny": dict(model=dict(d_model=32, num_layers=1, num_heads=8, d_ff=64, max_len=16),
                 data=dict(seq_len=16, batch_size=16)),
}
NOTE = ("fake CPU devices share this machine's cores: the figures measure the overhead "
        "of sharding, not a speed-up")


def bench_config(preset: str, steps: int, mesh: dict | None = None):
    import jtrain

    c = jtrain.defaults()
    c.model.update(PRESETS[preset]["model"])
    c.data.update(PRESETS[preset]["data"])
    c.total_steps = 2 * steps
    c.optim.update(warmup_steps=1)
    c.eval.update(every_steps=0, num_batches=1)
    c.log.update(every_steps=steps, writers=("jsonl",), verbosity=0)
    c.checkpoint.update(every_steps=0, async_save=False)
    c.mesh.update({"data": 1, "fsdp": 1, "tensor": 1, **(mesh or {})})
    return c


def _child_rates(preset: str, steps: int, strategies: list[str], workroot: str) -> dict:
    """In a process with n devices: examples/s per device for each strategy."""
    import jax

    from jtrain.engine.run import train

    n, out = jax.device_count(), {}
    for s in strategies:
        cfg = bench_config(preset, steps, {s: n})
        summary = train(cfg, os.path.join(workroot, f"{s}{n}")).summary
        out[s] = summary["perf/examples_per_sec"] / n
    return out


def _child_first_step(t0: float, preset: str, mode: str, workdir: str) -> dict:
    """Seconds from `t0` (before importing jax) to the first step's result."""
    if mode == "hand":
        import jax

        from jtrain.bench import overhead as bo

        loop = bo.HandLoop(bench_config(preset, 1))
        state, loss = loop.step(loop.init_state(), jax.device_put(next(loop.iterator())))
        jax.block_until_ready(loss)
        return {"time_to_first_step_sec": time.perf_counter() - t0}
    from jtrain.engine.run import train

    cfg = bench_config(preset, 1)
    cfg.total_steps, cfg.optim.warmup_steps = 1, 0
    summary = train(cfg, workdir).summary
    return {"time_to_first_step_sec": summary["perf/time_to_first_step_sec"],
            **{k: v for k, v in summary.items() if k.startswith(("startup/", "compile/"))
               and not k.endswith("causes")}}


def _spawn(code: str, devices: int, env: dict) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **env,
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"a bench process failed ({p.returncode}): "
                           f"{(p.stderr or p.stdout).strip().splitlines()[-1:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_scaling(*, preset: str = "small", devices=(1, 2, 4, 8), steps: int = 20,
                strategies=STRATEGIES, first_step: bool = True, progress=print) -> dict:
    res: dict = {"preset": preset, "steps": steps, "note": NOTE, "rates": {}}
    with tempfile.TemporaryDirectory(prefix="jtrain-scaling-") as root:
        for n in devices:
            todo = list(strategies) if n > 1 else list(strategies)[:1]  # all alike at 1
            progress(f"scaling: {n} device(s): {', '.join(todo)}")
            rates = _spawn("import json; from jtrain.bench import scaling as s; print(json.dumps("
                           f"s._child_rates({preset!r}, {steps}, {todo!r}, {root!r})))",
                           n, {})
            res["rates"][n] = {s: rates.get(s, rates[todo[0]]) for s in strategies}
        if first_step:
            cache = {"XDG_CACHE_HOME": os.path.join(root, "cache")}
            for mode in ("hand", "cold", "warm"):
                progress(f"scaling: time to first step, {mode}")
                res[mode] = _spawn(
                    "import time; t0 = time.perf_counter()\n"
                    "from jtrain.bench import scaling as s; import json\n"
                    f"print(json.dumps(s._child_first_step(t0, {preset!r}, {mode!r}, "
                    f"{os.path.join(root, mode)!r})))", 1, cache)
            h, c, w = (res[m]["time_to_first_step_sec"] for m in ("hand", "cold", "warm"))
            res["cold_vs_hand"], res["warm_vs_cold"] = c / h, w / c
    return res


def format_report(res: dict) -> str:
    strategies = list(next(iter(res["rates"].values())))
    lines = [f"scaling ({res['preset']} model, {res['steps']} timed steps per run): "
             f"examples/s per device", f"  note: {res['note']}",
             f"{'devices':>8}" + "".join(f"{s:>12}" for s in strategies)]
    for n, rates in res["rates"].items():
        lines.append(f"{n:>8}" + "".join(f"{rates[s]:>12.1f}" for s in strategies))
    if "cold" in res:
        h, c, w = (res[m]["time_to_first_step_sec"] for m in ("hand", "cold", "warm"))
        lines.append(f"time to first step: hand-written jax.jit loop {h:.2f} s; jtrain cold "
                     f"cache {c:.2f} s ({res['cold_vs_hand']:.2f}x hand, goal <= 1.5); warm "
                     f"{w:.2f} s ({res['warm_vs_cold']:.2f}x cold, goal <= 0.5)")
        for mode in ("cold", "warm"):
            r = res[mode]
            parts = [f"{k.split('/')[1][:-4]} {v:.2f}" for k, v in r.items()
                     if k.startswith("startup/")]
            lines.append(f"  jtrain {mode}: {', '.join(parts)} s; {r['compile/count']} "
                         f"compiles, {r['compile/cache_hits']} cache hits")
    return "\n".join(lines)
