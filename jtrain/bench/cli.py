"""Benchmarks of the jtrain engine itself: `python -m jtrain.bench <subcommand>`.

    python -m jtrain.bench overhead --model=base                # ~2-3 min on 2 CPU cores
    python -m jtrain.bench overhead --model=tiny --out=tiny.json
    python -m jtrain.bench overhead --model=tiny --rounds=7 --steps=1000 --log_every=100

`overhead`: the real training loop (`jtrain.train`) against a hand-written minimal
`jax.jit` loop on the same model, optimizer, initial parameters and numpy batches,
interleaved in one process (jtrain, hand, jtrain, hand, ...) so that drifting machine load
hits both sides alike. It prints one row per round, the median / min / max per-step time
of each side, tokens/s, MFU (GPU only), and the ratio of the medians (jtrain / hand)
against the goal: <= 1.02 for `base` (configs/base.py's model) and <= 1.10 for `tiny`
(a 1-layer d_model=32 transformer, batch 8 x 32 tokens, dispatch-bound).

Timing, in short (the details are in `jtrain.bench.overhead`'s docstring): both sides are
timed in steady state over the same `--steps` steps after the same `--log_every` warm-up
steps (which hold compilation). jtrain's time comes from the loop's own log records in
`metrics.jsonl` (wall-clock stamps taken after the logged step's metrics were fetched,
first interval dropped), so everything the loop does per step counts: the host->device
transfer, the bounded steps in flight, metric fetches, the writers and the progress line.
Setup, compilation and the end-of-run eval and checkpoint are reported apart as
"fixed s". The hand loop is timed with `perf_counter` up to `block_until_ready`. The
final losses of both sides are printed: equal losses show both did the same work.

    python -m jtrain.bench data                                 # ~1 min on 2 CPU cores
    python -m jtrain.bench data --num_workers=2 --out=data.json

`data`: on one torch map-style dataset (images), jtrain's data pipeline against
`torch.utils.data.DataLoader` (examples/s, goal >= 1.0x), the train step fed by the real
pipeline against a synthetic batch already on the devices (goal <= 1.03x), and the time to
first batch; medians over interleaved rounds (details in `jtrain.bench.data`).

    python -m jtrain.bench checkpoint                           # ~1-2 min on 2 CPU cores
    python -m jtrain.bench checkpoint --rounds=5 --writer_nice=0 --out=ckpt.json

`checkpoint`: a ~100 M-parameter model with AdamW state (~1.2 GiB) and the real train step
and Checkpointer: the time an async save blocks the loop vs a synchronous save (goal
<= 0.25x), the total save time and the restore time (goal <= 5 s each), and steps/s while
a save is written vs without (goal >= 0.95x); medians over rounds (details in
`jtrain.bench.checkpoint`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

NOT_IMPLEMENTED: tuple = ()
EXIT_USAGE = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jtrain.bench",
                                description="Benchmarks of the jtrain engine.")
    sub = p.add_subparsers(dest="command", metavar="{overhead,data,checkpoint}")
    o = sub.add_parser("overhead", help="jtrain loop vs a hand-written jax.jit loop",
                       description="Median step time of jtrain.train vs a minimal jax.jit "
                                   "loop, interleaved rounds, steady state.")
    o.add_argument("--model", default="base", choices=("base", "tiny"),
                   help="base: configs/base.py model; tiny: 1-layer d_model=32, batch 8")
    o.add_argument("--rounds", type=int, default=None, help="rounds per side (>= 3 advised)")
    o.add_argument("--steps", type=int, default=None, help="timed steps per round and side")
    o.add_argument("--log_every", type=int, default=None,
                   help="jtrain log interval = warm-up steps (compile) on both sides")
    o.add_argument("--workdir", default=None,
                   help="keep jtrain's run directories here (default: a temp dir, removed)")
    o.add_argument("--out", default=None, help="write the results as JSON to this file")
    d = sub.add_parser("data", help="jtrain's data pipeline vs torch's DataLoader",
                       description="examples/s vs torch DataLoader, step time with real vs "
                                   "synthetic data, time to first batch.")
    d.add_argument("--num_examples", type=int, default=4096)
    d.add_argument("--batch_size", type=int, default=128)
    d.add_argument("--num_workers", type=int, default=0, help="on both sides")
    d.add_argument("--rounds", type=int, default=5)
    d.add_argument("--batches", type=int, default=30, help="timed batches per round (a)")
    d.add_argument("--steps", type=int, default=20, help="timed steps per round and side (b)")
    d.add_argument("--out", default=None, help="write the results as JSON to this file")
    c = sub.add_parser("checkpoint", help="what async checkpointing costs the loop",
                       description="Loop blocked by async vs sync save, save and restore "
                                   "time, steps/s during a save; ~100 M params + AdamW.")
    c.add_argument("--params", type=float, default=100e6, help="model size (parameters)")
    c.add_argument("--rounds", type=int, default=3)
    c.add_argument("--steps", type=int, default=8, help="baseline train steps per round")
    c.add_argument("--writer_nice", type=int, default=19,
                   help="checkpoint.writer_nice for the background write (0-19)")
    c.add_argument("--workdir", default=None, help="where to write (default: a temp dir)")
    c.add_argument("--out", default=None, help="write the results as JSON to this file")
    for name in NOT_IMPLEMENTED:
        sub.add_parser(name, help="not implemented yet (exits 2)")
    return p


def _fmt_ms(v: float) -> str:
    return f"{v:.1f}" if v >= 100 else f"{v:.3g}" if v < 1 else f"{v:.2f}"


def format_report(res: dict) -> str:
    j, h = res["jtrain"], res["hand"]
    lines = [
        f"overhead {res['model']}: {res['rounds']} rounds x {res['steps']} steps "
        f"(+{res['log_every']} warm-up), batch {res['batch_size']} x seq {res['seq_len']}, "
        f"{res['backend']} ({res['device_kind']})",
        f"{'round':>6} {'jtrain ms':>10} {'hand ms':>10} {'ratio':>7} {'jtrain loss':>12} "
        f"{'hand loss':>10} {'jtrain fixed s':>15}",
    ]
    for i in range(res["rounds"]):
        lines.append(
            f"{i + 1:>6} {_fmt_ms(j['ms_per_step'][i]):>10} {_fmt_ms(h['ms_per_step'][i]):>10} "
            f"{res['paired_ratios'][i]:>7.3f} {j['final_loss'][i]:>12.5f} "
            f"{h['final_loss'][i]:>10.5f} {j['fixed_s'][i]:>15.1f}")
    for label, key in (("median", "median_ms"), ("min", "min_ms"), ("max", "max_ms")):
        lines.append(f"{label:>6} {_fmt_ms(j[key]):>10} {_fmt_ms(h[key]):>10} "
                     f"{j[key] / h[key]:>7.3f}")
    paired = res["paired_ratios"]
    lines.append(f"per-round ratios: median {statistics.median(paired):.3f}, "
                 f"min {min(paired):.3f}, max {max(paired):.3f}")
    lines.append(
        f"per-interval view ({sum(map(len, j['intervals_ms']))} jtrain / "
        f"{sum(map(len, h['intervals_ms']))} hand intervals of {res['log_every']} steps): "
        f"p10 {_fmt_ms(j['interval_p10_ms'])} / {_fmt_ms(h['interval_p10_ms'])} ms, ratio "
        f"{res['interval_p10_ratio']:.3f}; p50 {_fmt_ms(j['interval_p50_ms'])} / "
        f"{_fmt_ms(h['interval_p50_ms'])} ms, ratio {res['interval_p50_ratio']:.3f}")
    lines.append(f"tokens/s: jtrain {j['tokens_per_sec']:,.0f}, hand {h['tokens_per_sec']:,.0f}")
    if j["mfu"] is None:
        lines.append(f"MFU: {j['mfu_note']}")
    else:
        lines.append(f"MFU: jtrain {100 * j['mfu']:.1f}%, hand {100 * h['mfu']:.1f}%")
    lines.append(
        f"overhead {res['model']}: jtrain {_fmt_ms(j['median_ms'])} ms/step, hand "
        f"{_fmt_ms(h['median_ms'])} ms/step, ratio {res['ratio']:.3f} (goal <= {res['goal']})")
    return "\n".join(lines)


def _fail(message: str) -> int:
    sys.stderr.write(f"jtrain.bench: {message}\n")
    sys.stderr.flush()
    return EXIT_USAGE


def overhead(args) -> int:
    from jtrain.bench import overhead as bo  # imports JAX; --help and stubs stay fast
    from jtrain import config as config_lib

    defaults = bo.PRESETS[args.model]
    rounds = args.rounds if args.rounds is not None else defaults["rounds"]
    steps = args.steps if args.steps is not None else defaults["steps"]
    log_every = args.log_every if args.log_every is not None else defaults["log_every"]
    try:
        res = bo.run_overhead(args.model, rounds=rounds, steps=steps, log_every=log_every,
                              workdir=args.workdir,
                              progress=lambda s: print(s, file=sys.stderr, flush=True))
    except (bo.BenchError, config_lib.ConfigError) as e:
        return _fail(f"error: {e}")
    print(format_report(res), flush=True)
    if not (math.isfinite(res["ratio"]) and res["ratio"] > 0):
        return _fail(f"error: ratio {res['ratio']} is not a positive number")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2, sort_keys=True)
    return 0


def _absl_flags_parsed() -> None:
    """grain reads absl flags; outside absl.app nobody has parsed them (see PITFALLS)."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def main(argv=None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        _parser().print_help(sys.stderr)
        return EXIT_USAGE
    if args.command in NOT_IMPLEMENTED:
        return _fail(f"{args.command!r} is not implemented yet")
    _absl_flags_parsed()
    if args.command == "data":
        return data(args)
    if args.command == "checkpoint":
        return checkpoint(args)
    return overhead(args)


def checkpoint(args) -> int:
    if min(args.rounds, args.steps) < 1 or not 1e5 <= args.params <= 1e10 \
            or not 0 <= args.writer_nice <= 19:
        return _fail("error: --rounds and --steps must be >= 1, --params in [1e5, 1e10], "
                     "--writer_nice in [0, 19]")
    from jtrain.bench import checkpoint as bc  # imports JAX

    res = bc.run_checkpoint_bench(params=args.params, rounds=args.rounds, steps=args.steps,
                                  writer_nice=args.writer_nice, workdir=args.workdir,
                                  progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(bc.format_report(res), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2, sort_keys=True)
    return 0


def data(args) -> int:
    from jtrain.bench import data as bd  # imports JAX and torch

    if min(args.num_examples, args.batch_size, args.rounds, args.batches, args.steps) < 1 \
            or args.num_workers < 0 or args.num_examples < args.batch_size * (args.batches + 1):
        return _fail("error: sizes must be >= 1 (workers >= 0), and --num_examples must hold "
                     "--batches + 1 batches")
    try:
        res = bd.run(n=args.num_examples, batch=args.batch_size, workers=args.num_workers,
                     rounds=args.rounds, batches=args.batches, steps=args.steps,
                     progress=lambda s: print(s, file=sys.stderr, flush=True))
    except ImportError as e:
        return _fail(f"error: {e} (the data bench needs torch: pip install 'jtrain[torch]')")
    print(bd.format_report(res), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2, sort_keys=True)
    return 0

