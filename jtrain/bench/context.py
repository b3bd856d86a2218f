"""`python -m jtrain.bench context`: the built-in transformer with its sequences split
over `mesh.context=N` (N fake CPU devices) beside the plain model on one device, the
same model, batch and steps, each side in its own process: the loop's step time
(summary.json's perf/steps_per_sec, compilation excluded) and the train step's peak
memory per device (XLA's memory analysis, as `--dry_run` reports it), the split side
as a ratio to the plain one. Fake CPU devices share this machine's cores, so the
step-time ratio is what the split costs here, not a speed-up; the memory ratio is what
each device of a real mesh holds. The load average is recorded before and after.
"""

from __future__ import annotations

import os
import tempfile

from absl import flags

NOTE = ("fake CPU devices share this machine's cores: the step-time ratio is the cost of "
        "the split, not a speed-up; memory is per device")


def define_flags(fv) -> None:
    flags.DEFINE_integer("context", 4, "mesh.context of the split side (its fake CPU "
                         "devices)", flag_values=fv)
    flags.DEFINE_integer("seq_len", 1024, "tokens per sequence", flag_values=fv)
    flags.DEFINE_integer("steps", 10, "timed steps per side (after as many warm-up steps)",
                         flag_values=fv)
    flags.DEFINE_string("out", None, "write the results as JSON to this file", flag_values=fv)


def config(seq_len: int, steps: int, context: int) -> dict:
    return {"total_steps": 2 * steps, "seed": 0,
            "model": {"name": "transformer", "d_model": 64, "num_layers": 2, "num_heads": 4,
                      "d_ff": 256, "max_len": seq_len},
            "data": {"seq_len": seq_len, "batch_size": 2},
            "mesh": {"data": 1, "context": context},
            "eval": {"every_steps": 0, "num_batches": 1}, "checkpoint": {"every_steps": 0},
            "log": {"verbosity": 0, "every_steps": steps, "writers": ["jsonl"]}}


def child(seq_len: int, steps: int, context: int, workdir: str) -> dict:
    """In a process with `context` devices: step time and peak step memory per device."""
    from jtrain.engine import dry_run
    from jtrain.engine.run import train

    report = dry_run.run(config(seq_len, steps, context), say=lambda line: None)
    summary = train(config(seq_len, steps, context), workdir).summary
    return {"step_ms": 1000.0 / summary["perf/steps_per_sec"],
            "peak_bytes": report["memory"]["train_step"]["peak estimate"]}


def main(args) -> int:
    from jtrain.bench import command, scaling

    if args.context < 2 or args.seq_len % args.context or args.steps < 1:
        return command._fail("error: --context >= 2 dividing --seq_len, --steps >= 1")
    res: dict = {"context": args.context, "seq_len": args.seq_len, "steps": args.steps,
                 "note": NOTE, "load_before": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="jtrain-context-") as root:
        for side, n in (("plain", 1), ("split", args.context)):
            res[side] = scaling._spawn(
                "import json; from jtrain.bench import context as c; print(json.dumps("
                f"c.child({args.seq_len}, {args.steps}, {n}, {os.path.join(root, side)!r})))",
                n, {})
    res["load_after"] = os.getloadavg()[0]
    res["step_ratio"] = res["split"]["step_ms"] / res["plain"]["step_ms"]
    res["memory_ratio"] = res["split"]["peak_bytes"] / res["plain"]["peak_bytes"]
    print(format_report(res), flush=True)
    return command._write_out(args.out, res)


def format_report(res: dict) -> str:
    p, s, c = res["plain"], res["split"], res["context"]
    return "\n".join([
        f"context (d_model 64, 2 layers, 4 heads, batch 2 x {res['seq_len']} tokens, "
        f"{res['steps']} timed steps): plain on 1 device vs mesh.context={c} on {c} devices",
        f"  note: {res['note']}",
        f"{'':>26}{'plain':>10}{f'context={c}':>12}{'ratio':>8}",
        f"{'step time (ms)':>26}{p['step_ms']:>10.1f}{s['step_ms']:>12.1f}"
        f"{res['step_ratio']:>8.2f}",
        f"{'peak memory/device (MiB)':>26}{p['peak_bytes'] / 2**20:>10.2f}"
        f"{s['peak_bytes'] / 2**20:>12.2f}{res['memory_ratio']:>8.2f}",
        f"load average {res['load_before']:.1f} before, {res['load_after']:.1f} after"])
