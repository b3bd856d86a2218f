"""`python -m jtrain.bench pipeline`: pipeline stages against the plain model, side by
side in one process of 8 fake CPU devices: configs/base.py:debug with `--layers` blocks,
on mesh.data=8 (plain), and on mesh.stage=S x mesh.data=8/S for each of `--stages`
(mesh.microbatches `--microbatches`), the same batches of the built-in corpus. Per side:
the train step's peak memory per device (XLA's estimate) and the wall / CPU ms per step
(`jtrain.bench.invariant.time_sides`: the sides alternate over `--rounds`), as ratios to
the plain model, with the GPipe bubble counted from the schedule. Fake devices share the
machine's cores: the ratios show what the schedule's extra work and bubble cost, not a
speed-up.
"""

from __future__ import annotations

import json
from pathlib import Path

from absl import flags

DEVICES = 8


def define_flags(fv) -> None:
    flags.DEFINE_list("stages", ["2", "4"], "stage counts (each divides 8)", flag_values=fv)
    flags.DEFINE_integer("microbatches", 4, "mesh.microbatches", flag_values=fv)
    flags.DEFINE_integer("layers", 4, "model.num_layers", flag_values=fv)
    flags.DEFINE_integer("steps", 10, "timed steps per round and side", flag_values=fv)
    flags.DEFINE_integer("rounds", 3, "rounds (each: every side once)", flag_values=fv)
    flags.DEFINE_string("out", None, "write the results as JSON to this file", flag_values=fv)


def child(stages: list, microbatches: int, layers: int, steps: int, rounds: int) -> dict:
    """In the 8-device process: every side's step memory and times."""
    from jtrain.bench.invariant import _config, time_sides

    cfgs = {}
    for s in [1, *stages]:
        cfg = _config("debug", False, DEVICES // s)
        cfg.model.num_layers = layers
        cfg.mesh.stage, cfg.mesh.microbatches = s, microbatches
        cfgs["plain" if s == 1 else f"stage={s}"] = cfg
    return time_sides(cfgs, steps, rounds)


def format_report(res: dict) -> str:
    from jtrain.bench import machine as machine_lib
    from jtrain.bench.invariant import load_line
    from jtrain.mesh import bubble

    m, mem, plain = res["median"], res["memory"], res["median"]["plain"]
    lines = [machine_lib.header_line(res["machine"]),
             f"pipeline stages vs the plain model, configs/base.py:debug with "
             f"{res['layers']} blocks, {DEVICES} devices, {res['microbatches']} microbatches, "
             f"{res['steps']} steps x {len(res['rounds']['plain'])} rounds per side "
             "(medians; ratio = side / plain)",
             f"{'side':>9} {'bubble':>7} {'wall ms/step':>13} {'CPU ms/step':>12} "
             f"{'step peak MiB/device':>21} {'wall':>6} {'CPU':>6} {'memory':>7}"]
    for side, t in m.items():
        s = 1 if side == "plain" else int(side.split("=")[1])
        lines.append(f"{side:>9} {bubble(res['microbatches'], s):>7.1%} "
                     f"{t['wall_ms']:>13.1f} {t['cpu_ms']:>12.1f} "
                     f"{mem[side] / 2**20:>21.2f} {t['wall_ms'] / plain['wall_ms']:>5.2f}x "
                     f"{t['cpu_ms'] / plain['cpu_ms']:>5.2f}x "
                     f"{mem[side] / mem['plain']:>6.2f}x")
    return "\n".join([*lines, load_line(res, "before and after")])


def main(args) -> int:
    from jtrain.bench import machine as machine_lib
    from jtrain.bench.invariant import in_child

    try:
        stages = [int(s) for s in args.stages]
    except ValueError:
        stages = [0]
    if any(s < 2 or DEVICES % s or args.layers % s for s in stages):
        print(f"error: --stages: counts >= 2 dividing {DEVICES} and --layers={args.layers}")
        return 2
    if min(args.microbatches, args.steps, args.rounds) < 1:
        print("error: --microbatches, --steps and --rounds must be >= 1")
        return 2
    res = {"machine": machine_lib.machine(), "layers": args.layers, "steps": args.steps,
           "microbatches": args.microbatches,
           "loadavg": [machine_lib.loadavg()]}
    try:
        res.update(in_child(DEVICES, f"pipeline.child({stages}, {args.microbatches}, "
                                     f"{args.layers}, {args.steps}, {args.rounds})"))
    except RuntimeError as e:
        print(f"error: {e}")
        return 1
    res["loadavg"].append(machine_lib.loadavg())
    print(format_report(res), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return 0
