"""`python -m jtrain.bench variants`: one config's train step in several variants side
by side, each as a ratio to the first: a mixture of experts on the expert axis, 8-bit
matmuls (int8, fp8), bf16; step time, peak memory per device, model FLOPs and MFU.

    python -m jtrain.bench variants                       # base:debug on 8 fake devices
    python -m jtrain.bench variants --base=gpt2_small --devices=1 \\
        --variants=bf16,bf16_fp8 --steps=20               # tokens/s and MFU, one GPU

The devices' process is a child (fake CPU devices are fixed before JAX starts; on a GPU
`--devices` must be the real count). There every variant's step is built
(`jtrain.build`) and timed on the same batches, the variants alternating round by round
(jtrain.bench.invariant.time_sides: wall and CPU ms per step, medians; the peak is
XLA's estimate of the compiled step per device). Model FLOPs per step are
`flops_per_example` (6N + attention, the k active experts of a MoE) times the global
batch; MFU is that over the step time and the devices' peak FLOP/s
(jtrain.observe.perf's table): on a CPU the peak is unknown and no MFU is printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from absl import flags

# name -> dotted overrides; "moe" puts 8 experts (k 2) on the expert axis (all devices).
VARIANTS = {
    "plain": {},
    "moe": {"model.moe.experts": 8, "model.moe.k": 2, "mesh.expert": -1, "mesh.data": 1},
    "int8": {"model.quant": "int8"},
    "fp8": {"model.quant": "fp8"},
    "bf16": {"model.dtype": "bfloat16"},
    "bf16_fp8": {"model.dtype": "bfloat16", "model.quant": "fp8"},
}


def define_flags(fv) -> None:
    flags.DEFINE_string("base", "base:debug", "the config: configs/NAME.py[:variant]",
                        flag_values=fv)
    flags.DEFINE_list("variants", ["plain", "moe", "int8", "fp8"], "from "
                      + ", ".join(VARIANTS) + "; ratios are to the first", flag_values=fv)
    flags.DEFINE_integer("devices", 8, "devices (fake CPU devices on a CPU); mesh.data "
                         "takes them, the expert axis for moe", flag_values=fv)
    flags.DEFINE_integer("steps", 5, "timed steps per round and variant", flag_values=fv)
    flags.DEFINE_integer("rounds", 3, "rounds (each: every variant in turn)", flag_values=fv)
    flags.DEFINE_string("out", None, "write the results as JSON to this file", flag_values=fv)


def _config(name: str, variant: str, devices: int):
    import jtrain
    from jtrain.bench.overhead import CONFIGS, load_base_config

    path, _, tag = name.partition(":")
    cfg = load_base_config(CONFIGS / f"{path}.py", tag or None)
    cfg.mesh.update({"data": devices, "fsdp": 1, "tensor": 1})
    cfg.compile.cache_dir = ""
    for key, value in VARIANTS[variant].items():
        section, _, leaf = key.rpartition(".")
        node = cfg
        for part in section.split("."):
            node = node[part]
        node[leaf] = value
    return jtrain.resolve(cfg)


def child(name: str, variants: list[str], steps: int, rounds: int) -> dict:
    """In the devices' process: every variant's step time, memory, FLOPs and MFU."""
    import jax

    from jtrain import models
    from jtrain.bench.invariant import time_sides
    from jtrain.observe import perf

    n = jax.device_count()
    cfgs = {v: _config(name, v, n) for v in variants}
    out = {"devices": n, "device_kind": jax.devices()[0].device_kind,
           "peak_flops": perf.peak_flops_per_device(), **time_sides(cfgs, steps, rounds)}
    out["flops_per_step"] = {v: (models.flops_per_example(c.model, (c.data.seq_len,)) or 0)
                             * c.data.batch_size for v, c in cfgs.items()}
    out["tokens_per_step"] = {v: c.data.batch_size * c.data.seq_len for v, c in cfgs.items()}
    return out


def run(name: str, variants: list[str], devices: int, steps: int, rounds: int) -> dict:
    from jtrain.bench import machine as machine_lib

    res: dict = {"machine": machine_lib.machine(), "config": name, "steps": steps,
                 "rounds": rounds, "loadavg": [machine_lib.loadavg()]}
    env = {**os.environ}
    if env.get("JAX_PLATFORMS", "cpu") == "cpu" and _no_accelerator():
        env.update(JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    code = ("import json; from jtrain.bench import variants as b; "
            f"print(json.dumps(b.child({name!r}, {variants!r}, {steps}, {rounds})))")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"the devices' process failed ({p.returncode}): "
                           f"{(p.stderr or p.stdout).strip().splitlines()[-1:]}")
    timings = json.loads(p.stdout.strip().splitlines()[-1])
    res["timings"] = timings.pop("rounds")  # every round's figures
    res.update(timings)
    res["loadavg"].append(machine_lib.loadavg())
    return res


def _no_accelerator() -> bool:
    """No GPU driver on this machine (then the child fakes CPU devices)."""
    return not any(Path(p).exists() for p in ("/dev/nvidia0", "/dev/nvidiactl"))


def mfu_line(res: dict, variant: str) -> str:
    """The model FLOPs of a step and its MFU, or why there is none."""
    ms = res["median"][variant]["wall_ms"]
    flops = res["flops_per_step"][variant]
    tokens = res["tokens_per_step"][variant] * 1e3 / ms
    head = (f"{variant}: {tokens:,.0f} tokens/s, model FLOPs per step {flops:.3e}")
    if not res["peak_flops"]:
        return f"{head}; unknown peak ({res['device_kind']}): no MFU"
    mfu = flops * 1e3 / ms / (res["peak_flops"] * res["devices"])
    return (f"{head}; MFU {mfu:.1%} (peak {res['peak_flops'] / 1e12:.0f} TFLOP/s per "
            f"device, {res['device_kind']})")


def format_report(res: dict) -> str:
    from jtrain.bench import machine as machine_lib

    sides = list(res["median"])
    base, m, mem = sides[0], res["median"], res["memory"]
    lines = [machine_lib.header_line(res["machine"]),
             f"variants of configs/{res['config']} on {res['devices']} device(s) "
             f"({res['device_kind']}), {res['steps']} steps x {res['rounds']} rounds each "
             f"(medians; ratio to {base})",
             f"{'variant':>9} {'wall ms/step':>13} {'CPU ms/step':>12} "
             f"{'peak MiB/device':>16} {'time ratio':>11} {'memory ratio':>13}"]
    for side in sides:
        lines.append(f"{side:>9} {m[side]['wall_ms']:>13.1f} {m[side]['cpu_ms']:>12.1f} "
                     f"{mem[side] / 2**20:>16.2f} "
                     f"{m[side]['wall_ms'] / m[base]['wall_ms']:>10.2f}x "
                     f"{mem[side] / mem[base]:>12.2f}x")
    lines += [mfu_line(res, side) for side in sides]
    lines.append("load average (1 min) before and after: "
                 + " ".join(f"{v:.2f}" for v in res["loadavg"])
                 + f" on {res['machine']['cores']} cores")
    return "\n".join(lines)


def main(args) -> int:
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or not args.variants or min(args.steps, args.rounds, args.devices) < 1:
        print(f"error: --variants from {', '.join(VARIANTS)}; --devices, --steps, "
              "--rounds >= 1")
        return 2
    try:
        res = run(args.base, args.variants, args.devices, args.steps, args.rounds)
    except RuntimeError as e:
        print(f"error: {e}")
        return 1
    print(format_report(res), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return 0
