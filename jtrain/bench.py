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

Timing, in short (the details are in `jtrain.bench_overhead`'s docstring): both sides are
timed in steady state over the same `--steps` steps after the same `--log_every` warm-up
steps (which hold compilation). jtrain's time comes from the loop's own log records in
`metrics.jsonl` (wall-clock stamps taken after the logged step's metrics were fetched,
first interval dropped), so everything the loop does per step counts: the host->device
transfer, the bounded steps in flight, metric fetches, the writers and the progress line.
Setup, compilation and the end-of-run eval and checkpoint are reported apart as
"fixed s". The hand loop is timed with `perf_counter` up to `block_until_ready`. The
final losses of both sides are printed: equal losses show both did the same work.

`data` and `checkpoint` are reserved for future benchmarks and exit 2 for now.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

NOT_IMPLEMENTED = ("data", "checkpoint")
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
    paired = sorted(res["paired_ratios"])
    lines.append(f"per-round ratios: median {paired[len(paired) // 2]:.3f}, "
                 f"min {paired[0]:.3f}, max {paired[-1]:.3f}")
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
    from jtrain import bench_overhead as bo  # imports JAX; --help and stubs stay fast
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
    return overhead(args)


if __name__ == "__main__":
    sys.exit(main())
