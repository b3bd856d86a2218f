"""`python -m jtrain.bench invariant`: what determinism.topology_invariant costs, mode vs
default, on 1 and 8 fake CPU devices, side by side.

Each device count runs in its own process (fake CPU devices are fixed before JAX
starts). There, the train step of configs/base.py:debug (or the reference config,
`--variant=base`) is built twice, the mode on and off (`jtrain.build`, mesh.data = the
device count), both from the same initial state and on the same batches of the built-in
corpus; after one step each (the compile), `--rounds` rounds alternate the two sides, each
timing `--steps` steps: the wall time per step (`perf_counter` up to
`block_until_ready`) and the CPU seconds per step of the process (`process_time`: every
thread, XLA's included). The medians and their ratio (mode / default) are reported,
with the train step's peak memory per device (XLA's estimate from the compiled
programs: arguments + outputs - aliased + temporaries; the mode's is its larger
program's). On fake devices all "devices" share the machine's cores: the 8-device
figures show what the mode's dispatch and gathers cost, not a speed-up.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from absl import flags

SIDES = ("default", "invariant")


def define_flags(fv) -> None:
    flags.DEFINE_list("devices", ["1", "8"], "fake CPU device counts", flag_values=fv)
    flags.DEFINE_enum("variant", "debug", ["debug", "base"], "configs/base.py's variant: "
                      "debug (seconds) or base (the reference run)", flag_values=fv)
    flags.DEFINE_integer("steps", 10, "timed steps per round and side", flag_values=fv)
    flags.DEFINE_integer("rounds", 3, "rounds (each: default, then the mode)", flag_values=fv)
    flags.DEFINE_string("out", None, "write the results as JSON to this file", flag_values=fv)


def _config(variant: str, on: bool, devices: int):
    import importlib.util

    import jtrain

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "configs", "base.py")
    spec = importlib.util.spec_from_file_location("jtrain_bench_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config(variant if variant != "base" else None)
    cfg.mesh.update({"data": devices, "fsdp": 1, "tensor": 1})
    cfg.determinism.topology_invariant = on
    cfg.compile.cache_dir = ""
    return jtrain.resolve(cfg)


def child(variant: str, steps: int, rounds: int) -> dict:
    """In a process with N devices: both sides' step times and step memory."""
    import jax

    n = jax.device_count()
    return time_sides({side: _config(variant, side == "invariant", n) for side in SIDES},
                      steps, rounds)


def time_sides(cfgs: dict, steps: int, rounds: int) -> dict:
    """{side: resolved config} (the first one's data feeds all) -> each side's train step
    memory per device and wall / CPU ms per step, rounds alternating the sides."""
    import itertools

    import jax
    import numpy as np

    import jtrain
    from jtrain import data as data_lib
    from jtrain import mesh as mesh_lib
    from jtrain.bench.overhead import iterator_kwargs
    from jtrain.control import memory as memory_lib

    first = next(iter(cfgs.values()))
    source, _, _ = data_lib.make_sources(first.data)
    example = {k: np.asarray(v) for k, v in source[0].items()}
    batches = list(itertools.islice(data_lib.make_train_iterator(
        source, **iterator_kwargs(first)), steps + 1))
    sides, out = {}, {"devices": jax.device_count(), "memory": {},
                      "rounds": {s: [] for s in cfgs}}
    for side, cfg in cfgs.items():
        b = jtrain.build(cfg, sample=example["inputs"], eval_example=example,
                         byte_level=True)
        with mesh_lib.model_context(b.mesh):
            on = [mesh_lib.host_to_device(x, b.mesh) for x in batches]
            batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                sharding=x.sharding), on[0])
            compiled = b.train_step.lower(b.abstract_with_shardings(), batch).compile()
            out["memory"][side] = memory_lib.step_bytes(compiled)
            state, _ = b.train_step(b.init(), on[0])  # the compile
            jax.block_until_ready(state)
        sides[side] = [b, state, on]
    for _ in range(rounds):
        for side in cfgs:
            b, state, on = sides[side]
            with mesh_lib.model_context(b.mesh):
                t0, c0 = time.perf_counter(), time.process_time()
                for x in on[1:]:
                    state, metrics = b.train_step(state, x)
                jax.block_until_ready((state, metrics))
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            sides[side][1] = state
            out["rounds"][side].append({"wall_ms": 1e3 * wall / steps,
                                        "cpu_ms": 1e3 * cpu / steps})
    out["median"] = {s: {k: statistics.median(r[k] for r in out["rounds"][s])
                         for k in ("wall_ms", "cpu_ms")} for s in cfgs}
    return out


def run(devices: list[int], variant: str, steps: int, rounds: int) -> dict:
    from jtrain.bench import machine as machine_lib

    res: dict = {"machine": machine_lib.machine(), "config": f"configs/base.py:{variant}",
                 "steps": steps, "rounds": rounds, "devices": {}, "loadavg": []}
    for n in devices:
        res["loadavg"].append(machine_lib.loadavg())
        res["devices"][n] = in_child(n, f"invariant.child({variant!r}, {steps}, {rounds})")
    res["loadavg"].append(machine_lib.loadavg())
    return res


def in_child(n: int, call: str):
    """`call` (an expression over `jtrain.bench.<module>`) evaluated in a process with `n`
    fake CPU devices; its JSON result."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}
    code = (f"import json; from jtrain.bench import {call.split('.')[0]}; "
            f"print(json.dumps({call}))")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"the {n}-device process failed ({p.returncode}): "
                           f"{(p.stderr or p.stdout).strip().splitlines()[-1:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def format_report(res: dict) -> str:
    from jtrain.bench import machine as machine_lib

    lines = [machine_lib.header_line(res["machine"]),
             f"determinism.topology_invariant vs default, {res['config']}, {res['steps']} "
             f"steps x {res['rounds']} rounds per side (medians; mode / default)",
             f"{'devices':>8} {'side':>10} {'wall ms/step':>13} {'CPU ms/step':>12} "
             f"{'step peak MiB/device':>21}"]
    for n, r in res["devices"].items():
        m, mem = r["median"], r["memory"]
        for side in SIDES:
            lines.append(f"{n:>8} {side:>10} {m[side]['wall_ms']:>13.1f} "
                         f"{m[side]['cpu_ms']:>12.1f} {mem[side] / 2**20:>21.2f}")
        lines.append(f"{n:>8} {'ratio':>10} "
                     f"{m['invariant']['wall_ms'] / m['default']['wall_ms']:>12.2f}x "
                     f"{m['invariant']['cpu_ms'] / m['default']['cpu_ms']:>11.2f}x "
                     f"{mem['invariant'] / mem['default']:>20.2f}x")
    lines.append(load_line(res, "before each device count and after"))
    return "\n".join(lines)


def load_line(res: dict, when: str) -> str:
    return (f"load average (1 min) {when}: " + " ".join(f"{v:.2f}" for v in res["loadavg"])
            + f" on {res['machine']['cores']} cores")


def main(args) -> int:
    try:
        devices = [int(d) for d in args.devices]
    except ValueError:
        print(f"error: --devices: device counts, e.g. 1,8; got {','.join(args.devices)}")
        return 2
    if min(args.steps, args.rounds, *devices) < 1:
        print("error: --devices, --steps and --rounds must be >= 1")
        return 2
    try:
        res = run(devices, args.variant, args.steps, args.rounds)
    except RuntimeError as e:
        print(f"error: {e}")
        return 1
    print(format_report(res), flush=True)
    if args.out:  # the JSON: every round's figures, the machine, the loads
        Path(args.out).write_text(json.dumps(res, indent=2))
    return 0
