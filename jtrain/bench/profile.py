"""`python -m jtrain.bench profile`: where the train step's time goes, op by op.

The step profiled is `bench overhead`'s hand-written loop (the model, optimizer and
batches jtrain trains, jitted outside jtrain): `--steps` steps after three warm-up steps
run under `jax.profiler`, with XLA:CPU's per-op trace events on
(`--xla_cpu_enable_xprof_traceme`; set here before JAX starts its backend). The trace is
read in-process with `jax.profiler.ProfileData` (no TensorBoard or xprof needed) and
joined with the compiled step's HLO: each op's time per step, its output shape and, for
matrix products, its FLOPs and GFLOP/s. Ops are grouped as matmul (YNNPACK fusions and
Eigen dots), copy/transpose (fusions that only move data into another layout) and
elementwise (every other fusion). Also reported: the bytes those copies write per step,
the step's scratch size (`memory_analysis()`), wall time per step and the load average.

The op times add up to more than the wall time when ops overlap on the cores and to
less when the cores wait; shares are of the op total. On a loaded machine (load above
the core count) every op is stretched by preemption: the report says so.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import tempfile
import time

from absl import flags

TRACEME = "--xla_cpu_enable_xprof_traceme=true"
OP_LINE = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (\w+\[[\d,]*\])\S* (fusion|dot|copy|"
                     r"transpose)\((.*)")
DOT_LINE = re.compile(r"= (\w+\[[\d,]*\])\S* dot\((%[\w.\-]+), (%[\w.\-]+)\),"
                      r".*? lhs_contracting_dims=\{([\d,]*)\}")


def define_flags(fv) -> None:
    flags.DEFINE_enum("model", "base", ["base", "tiny", "gpt2_debug"], "bench overhead's "
                      "presets: base = configs/base.py's model", flag_values=fv)
    flags.DEFINE_integer("steps", 5, "profiled steps (after 3 warm-up steps)", flag_values=fv)
    flags.DEFINE_integer("top", 25, "ops listed", flag_values=fv)
    flags.DEFINE_string("out", None, "write the results as JSON to this file", flag_values=fv)


def _dims(shape: str) -> list[int]:
    inner = shape[shape.index("[") + 1:shape.index("]")]
    return [int(d) for d in inner.split(",") if d]


def _size(shape: str) -> int:
    n = 1
    for d in _dims(shape):
        n *= d
    return n


def hlo_ops(text: str) -> dict:
    """name -> {"shape", "kind", "flops", "copy"} for the entry computation's ops, from
    the compiled step's HLO text; a fusion's FLOPs are those of the dots it calls."""
    bodies, shapes = {}, {}
    for m in re.finditer(r"^(%[\w.\-]+) [^\n]*\{\n(.*?)\n\}", text, re.S | re.M):
        bodies[m.group(1)] = m.group(2)
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?(%[\w.\-]+) = (\w+\[[\d,]*\])", line)
        if m:
            shapes[m.group(1)] = m.group(2)
        for p in re.finditer(r"(%?[\w.\-]+): (\w+\[[\d,]*\])", line.split("->")[0]):
            shapes.setdefault("%" + p.group(1).lstrip("%"), p.group(2))

    def dot_flops(line: str) -> int:
        m = DOT_LINE.search(line)
        if not m or m.group(2) not in shapes:
            return 0
        lhs, k = _dims(shapes[m.group(2)]), 1
        for d in m.group(4).split(","):
            k *= lhs[int(d)] if d else 1
        return 2 * _size(m.group(1)) * k

    ops = {}
    entry = text[text.find("\nENTRY"):]
    for line in entry.splitlines():
        m = OP_LINE.match(line)
        if not m:
            continue
        name, shape, kind = m.group(1), m.group(2), m.group(3)
        called = re.search(r"calls=(%[\w.\-]+)", line)
        body = bodies.get(called.group(1), "") if called else line
        flops = sum(dot_flops(x) for x in body.splitlines() if " dot(" in x)
        moves = kind in ("copy", "transpose") or (kind == "fusion" and not flops and (
            "copy" in name or "transpose" in name))
        ops[name] = {"shape": shape, "kind": kind, "flops": flops, "copy": moves}
    return ops


def group(op: dict | None) -> str:
    if op is None:
        return "other"
    if op["flops"]:
        return "matmul"
    return "copy/transpose" if op["copy"] else "elementwise"


def trace_times(path: str, steps: int) -> dict:
    """op name -> ms per step, summed over XLA:CPU's trace events in the xplane file."""
    import jax

    data = jax.profiler.ProfileData.from_file(path)
    total = collections.defaultdict(float)
    for plane in data.planes:
        if plane.name.startswith("/host:CPU"):
            for line in plane.lines:
                for ev in line.events:
                    total[ev.name] += ev.duration_ns
    return {k: v / 1e6 / steps for k, v in total.items()}


def run(model: str, steps: int) -> dict:
    import jax

    from jtrain import internals

    if TRACEME not in os.environ.get("XLA_FLAGS", ""):
        if internals.backends_started():
            raise RuntimeError("JAX started before the profile could set " + TRACEME)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + TRACEME).strip()
    from jtrain.bench import machine as machine_lib
    from jtrain.bench import overhead

    loop = overhead.HandLoop(overhead.bench_config(model, steps, 3))
    it, state = loop.iterator(), loop.init_state()
    batches = [jax.device_put(next(it)) for _ in range(steps + 3)]
    step = loop.step.lower(state, batches[0]).compile()  # run as compiled: one compile
    for b in batches[:3]:
        state, loss = step(state, b)
    jax.block_until_ready(state)
    with tempfile.TemporaryDirectory() as d, machine_lib.LoadWatch() as watch:
        jax.profiler.start_trace(d)
        t0 = time.perf_counter()
        for b in batches[3:]:
            state, loss = step(state, b)
        jax.block_until_ready((state, loss))
        wall = 1e3 * (time.perf_counter() - t0) / steps
        jax.profiler.stop_trace()
        times = trace_times(sorted(glob.glob(f"{d}/**/*.xplane.pb", recursive=True))[-1],
                            steps)
    ops = hlo_ops(step.as_text())
    rows = []
    for name, op in ops.items():
        if name in times:
            ms = times[name]
            rows.append({"op": name, "group": group(op), "ms": round(ms, 3),
                         "shape": op["shape"], "gflop": round(op["flops"] / 1e9, 4),
                         "gflops_per_s": round(op["flops"] / ms / 1e6, 1) if op["flops"]
                         and ms else None})
    rows.sort(key=lambda r: -r["ms"])
    groups = collections.defaultdict(float)
    for r in rows:
        groups[r["group"]] += r["ms"]
    busy = sum(groups.values())
    matmul_flops = sum(op["flops"] for op in ops.values())
    copied = sum(4 * _size(op["shape"]) for op in ops.values() if op["copy"])
    return {"bench": "profile", "model": model, "steps": steps, "wall_ms": round(wall, 1),
            "op_ms": round(busy, 1), "groups": {k: round(v, 1) for k, v in groups.items()},
            "matmul_gflop": round(matmul_flops / 1e9, 2),
            "matmul_gflops_per_s": round(matmul_flops / groups["matmul"] / 1e6, 1)
            if groups.get("matmul") else None,
            "copied_mib": round(copied / 2**20, 1),
            "scratch_mib": round(step.memory_analysis().temp_size_in_bytes / 2**20, 1),
            "final_loss": float(loss), "ops": rows, "load": watch.record,
            "machine": machine_lib.machine(), "xla_flags": os.environ.get("XLA_FLAGS", "")}


def format_report(res: dict, top: int) -> str:
    from jtrain.bench import machine as machine_lib

    lines = [f"profile {res['model']}: {res['steps']} steps, wall {res['wall_ms']} ms/step, "
             f"ops {res['op_ms']} ms/step (each op's duration, summed)",
             f"matmuls {res['matmul_gflop']} GFLOP/step at {res['matmul_gflops_per_s']} "
             f"GFLOP/s of op time; copies/transposes write {res['copied_mib']} MiB/step; "
             f"scratch {res['scratch_mib']} MiB"]
    for g, ms in sorted(res["groups"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {g:<15} {ms:8.1f} ms  {100 * ms / res['op_ms']:5.1f} %")
    lines.append(f"{'ms/step':>8}  {'group':<15} {'GFLOP/s':>8}  {'shape':<22} op")
    for r in res["ops"][:top]:
        rate = f"{r['gflops_per_s']:.1f}" if r["gflops_per_s"] else ""
        lines.append(f"{r['ms']:8.2f}  {r['group']:<15} {rate:>8}  {r['shape']:<22} {r['op']}")
    lines.append(machine_lib.loads_line([res["load"]]))
    lines.append(machine_lib.header_line(res["machine"]))
    return "\n".join(lines)


def main(args) -> int:
    import json

    if args.steps < 1 or args.top < 0:
        print("error: --steps must be >= 1, --top >= 0")
        return 2
    res = run(args.model, args.steps)
    print(format_report(res, args.top), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return 0
