"""Benchmarks of the jtrain engine itself: `python -m jtrain.bench NAME [flags]`.

    python -m jtrain.bench overhead --model=tiny --out=tiny.json
    python -m jtrain.bench table tiny.json       # a --out JSON as markdown tables

Each benchmark's module (`jtrain.bench.overhead`, `.data`, `.checkpoint`, ...) says what
it times and against what; docs/benchmarks.md has the goals and the measurements. Every
one records the machine, the commit, the date and the load (`jtrain.bench.machine`): a
value measured while the load exceeded the core count is marked unreliable.
"""

from __future__ import annotations

import json
import math
import shlex
import statistics
import sys

from absl import flags

from jtrain import errors
from jtrain.bench import machine as machine_lib

NOT_IMPLEMENTED: tuple = ()
EXIT_USAGE = 2


def _overhead_flags(fv) -> None:
    flags.DEFINE_enum("model", "base", ["base", "tiny", "gpt2", "gpt2_debug"],
                      "base: configs/base.py model; tiny: 1-layer d_model=32, batch 8; gpt2: "
                      "configs/gpt2_small.py (124 M, for a GPU); gpt2_debug: its debug "
                      "variant", flag_values=fv)
    flags.DEFINE_integer("rounds", None, "rounds, each timing both sides (an even number: "
                         "each side runs first as often)", flag_values=fv)
    flags.DEFINE_integer("steps", None, "timed steps per round and side", flag_values=fv)
    flags.DEFINE_integer("log_every", None, "jtrain log interval = warm-up steps (compile) "
                         "on both sides", flag_values=fv)
    flags.DEFINE_string("workdir", None, "keep jtrain's run directories here (default: a "
                        "temp dir, removed)", flag_values=fv)
    flags.DEFINE_string("out", None, "write the results as JSON to this file", flag_values=fv)


def _data_flags(fv) -> None:
    flags.DEFINE_integer("num_examples", 8192, "dataset size", flag_values=fv)
    flags.DEFINE_integer("batch_size", 128, "batch size", flag_values=fv)
    flags.DEFINE_integer("num_workers", 0, "loader workers, on both sides", flag_values=fv)
    flags.DEFINE_integer("rounds", 5, "rounds", flag_values=fv)
    flags.DEFINE_integer("batches", 30, "timed batches per round (a)", flag_values=fv)
    flags.DEFINE_integer("steps", 20, "timed steps per round and side (b)", flag_values=fv)
    flags.DEFINE_string("out", None, "write the results as JSON to this file", flag_values=fv)


def _peers_flags(fv) -> None:
    flags.DEFINE_list("cases", ["mlp", "lm_debug", "lm_base"], "cases to run: mlp, "
                      "lm_debug, lm_base, lm_tiny", flag_values=fv)
    flags.DEFINE_integer("rounds", 3, "whole runs per side and case (sides alternate)",
                         flag_values=fv)
    flags.DEFINE_integer("steps", None, "steps per run (default per case; rounded to a "
                         "multiple of 4 evals)", flag_values=fv)
    flags.DEFINE_string("workdir", None, "keep the runs' files here (default: a temp dir, "
                        "removed)", flag_values=fv)
    flags.DEFINE_string("out", None, "write the results as JSON to this file", flag_values=fv)


def _checkpoint_flags(fv) -> None:
    flags.DEFINE_float("params", 100e6, "model size (parameters)", flag_values=fv)
    flags.DEFINE_integer("rounds", 3, "rounds", flag_values=fv)
    flags.DEFINE_integer("steps", 8, "baseline train steps per round", flag_values=fv)
    flags.DEFINE_integer("writer_nice", 19, "JTRAIN_WRITER_NICE for the background "
                         "write (0-19)", flag_values=fv)
    flags.DEFINE_string("workdir", None, "where to write (default: a temp dir)", flag_values=fv)
    flags.DEFINE_string("out", None, "write the results as JSON to this file", flag_values=fv)


def _console_flags(fv) -> None:
    flags.DEFINE_integer("updates", 2000, "progress updates per round and side", flag_values=fv)
    flags.DEFINE_integer("rounds", 3, "rounds", flag_values=fv)
    flags.DEFINE_integer("columns", 120, "the pseudo-terminal's width", flag_values=fv)
    flags.DEFINE_string("out", None, "write the results as JSON to this file", flag_values=fv)


def console(args) -> int:
    if min(args.updates, args.rounds) < 1 or args.columns < 20:
        return _fail("error: --updates and --rounds must be >= 1, --columns >= 20")
    from jtrain.bench import console as bcon

    res = bcon.run(updates=args.updates, rounds=args.rounds, columns=args.columns)
    print(bcon.format_report(res), flush=True)
    return _write_out(args.out, res)


def _scaling_flags(fv) -> None:
    flags.DEFINE_enum("model", "small", ["small", "tiny"], "small: d_model=64, 2 layers, "
                      "8 heads, batch 32 x 64; tiny: d_model=32, 1 layer, batch 16 x 16",
                      flag_values=fv)
    flags.DEFINE_list("devices", ["1", "2", "4", "8"], "fake CPU device counts",
                      flag_values=fv)
    flags.DEFINE_list("strategies", ["data", "fsdp", "tensor"], "mesh axes to scale",
                      flag_values=fv)
    flags.DEFINE_integer("steps", 20, "timed steps per run (after as many warm-up steps)",
                         flag_values=fv)
    flags.DEFINE_bool("first_step", True, "also time the first step: hand-written loop, "
                      "jtrain cold and warm compile cache", flag_values=fv)
    flags.DEFINE_string("out", None, "write the results as JSON to this file", flag_values=fv)


def scaling(args) -> int:
    try:
        devices = [int(d) for d in args.devices]
    except ValueError:
        return _fail(f"error: --devices: integers, got {','.join(args.devices)}")
    bad = [s for s in args.strategies if s not in ("data", "fsdp", "tensor")]
    if bad or not devices or min(devices) < 1 or args.steps < 1:
        return _fail("error: --devices >= 1, --strategies from data,fsdp,tensor, --steps >= 1")
    from jtrain.bench import scaling as bs

    try:
        res = bs.run_scaling(preset=args.model, devices=devices, steps=args.steps,
                             strategies=args.strategies, first_step=args.first_step,
                             progress=lambda s: print(s, file=sys.stderr, flush=True))
    except RuntimeError as e:
        return _fail(f"error: {e}")
    print(bs.format_report(res), flush=True)
    return _write_out(args.out, res)


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
        mj, mh = (machine_lib.mark(x["load"][i]) for x in (j, h))
        lines.append(
            f"{i + 1:>6} {_fmt_ms(j['ms_per_step'][i]) + mj:>10} "
            f"{_fmt_ms(h['ms_per_step'][i]) + mh:>10} "
            f"{res['paired_ratios'][i]:>7.3f} {j['final_loss'][i]:>12.5f} "
            f"{h['final_loss'][i]:>10.5f} {j['fixed_s'][i]:>15.1f}")
    for label, key in (("median", "median_ms"), ("min", "min_ms"), ("max", "max_ms")):
        lines.append(f"{label:>6} {_fmt_ms(j[key]):>10} {_fmt_ms(h[key]):>10} "
                     f"{j[key] / h[key]:>7.3f}")
    differ = sum(a != b for a, b in zip(j["final_loss"], h["final_loss"], strict=True))
    lines.append(f"final loss: differs in {differ} rounds" if differ else
                 "final loss: the same to the bit on both sides in every round")
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
        lines.append(f"MFU: jtrain {100 * j['mfu']:.1f}%, hand {100 * h['mfu']:.1f}% "
                     f"{j['mfu_note']}")
    lines.append(machine_lib.loads_line(j["load"] + h["load"]))
    lines.append(machine_lib.header_line(res["machine"]))
    lines.append(
        f"overhead {res['model']}: jtrain {_fmt_ms(j['median_ms'])} ms/step, hand "
        f"{_fmt_ms(h['median_ms'])} ms/step, ratio {res['ratio']:.3f} (goal <= {res['goal']})")
    return "\n".join(lines)


_ARGV: list = []  # this command's arguments (main): the JSON's "command"


def _write_out(path: str | None, res: dict) -> int:
    """--out: the results as JSON (every benchmark's flag); exit status 0."""
    if _ARGV:
        res.setdefault("command", shlex.join(["python", "-m", "jtrain.bench", *_ARGV]))
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=2, sort_keys=True)
    return 0


def _fail(message: str) -> int:
    """`jtrain: usage error: <message>` on stderr (the one-line form of jtrain.errors)."""
    message = message[len("error: "):] if message.startswith("error: ") else message
    sys.stderr.write(f"jtrain: usage error: {message}\n")
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
    return _write_out(args.out, res)


def commands() -> dict:
    """name -> (its flags, the benchmark, one line of help)."""
    return {
        "overhead": (_overhead_flags, overhead, "jtrain loop vs a hand-written jax.jit loop"),
        "data": (_data_flags, data, "jtrain's data pipeline vs torch's DataLoader"),
        "checkpoint": (_checkpoint_flags, checkpoint, "what async checkpointing costs the loop"),
        "console": (_console_flags, console, "the progress bar on a terminal vs plain lines"),
        "scaling": (_scaling_flags, scaling, "examples/s per device at 1-8 devices; time "
                    "to first step, cold vs warm compile cache"),
        "peers": (_peers_flags, peers, "jtrain vs plain PyTorch and Lightning, same work"),
        "population": (*_module_bench("population"), "K runs one after another vs one "
                       "population of K (one compiled step)"),
        "sam": (*_module_bench("sam"), "the SAM recipe's step (two gradients) vs the "
                "built-in update of the same MLP and AdamW"),
        "profile": (*_module_bench("profile"), "the train step's time op by op (XLA:CPU "
                    "trace), matmul GFLOP/s, copies"),
        "async_eval": (*_module_bench("async_eval"), "a run with frequent evaluation: "
                       "no evals vs eval.mode=sync vs async (the loop's step time without "
                       "waits, waits, saves, CPU seconds, wall time)"),
        "variants": (*_module_bench("variants"), "one config's step as plain, MoE on "
                     "the expert axis, int8, fp8, bf16: time and memory ratios, MFU"),
        "invariant": (*_module_bench("invariant"), "determinism.topology_invariant vs "
                      "default: step time and step memory on 1 and 8 devices"),
        "pipeline": (*_module_bench("pipeline"), "pipeline stages vs the plain model on "
                     "8 fake devices: step time and peak memory per device, as ratios"),
        "sample": (*_module_bench("sample"), "decode tokens/s: jtrain sample with its KV "
                   "cache, without it, and transformers' generate on the same export"),
        "tokens": (*_module_bench("tokens"), "token shards: tokens/s the reader delivers "
                   "vs tokens/s the train step consumes (base config)"),
        "context": (*_module_bench("context"), "the built-in transformer split over "
                    "mesh.context vs the plain model: step time and memory per device"),
        "table": (lambda fv: None, table, "a benchmark's --out JSON as a markdown table"),
    }


def _module_bench(name: str):
    """(flags, bench) of a benchmark module defining define_flags(fv) and main(args),
    imported only when that benchmark runs."""
    import importlib

    def module():
        return importlib.import_module(f"jtrain.bench.{name}")

    return (lambda fv: module().define_flags(fv)), (lambda args: module().main(args))


def table(args, files: list) -> int:
    from jtrain.bench import table as bt

    if len(files) != 1:
        return _fail("error: table takes one file: python -m jtrain.bench table FILE.json")
    try:
        print(bt.markdown(files[0]), flush=True)
    except bt.TableError as e:
        return _fail(f"error: {e}")
    return 0


PROG = "python -m jtrain.bench"
DESCRIPTION = "Benchmarks of the jtrain engine itself: jtrain bench NAME [flags]."


def _name(argv) -> str | None:
    """The benchmark `argv` names (its first positional argument), if any."""
    return next((a for a in argv if not a.startswith("-")), None)


def _usage(benches: dict) -> str:
    return ("usage: python -m jtrain.bench {" + ",".join(benches) + "} [flags]\n\n"
            + "".join(f"  {k:<11} {v[2]}\n" for k, v in benches.items()))


def define_flags(fv, argv) -> None:
    """The flags of the benchmark `argv` names; with none named, `--help` prints the list
    of benchmarks (exit 0). An unknown or unimplemented name is a UsageError."""
    benches = commands()
    name = _name(argv[1:])
    if name is None:
        if any(a in ("--help", "-h") for a in argv):
            sys.stdout.write(_usage(benches) + "\n" + (__doc__ or "") + "\n")
            raise SystemExit(0)
        return
    if name in NOT_IMPLEMENTED:
        raise errors.UsageError(f"{name!r} is not implemented yet")
    if name not in benches:
        raise errors.UsageError(f"unknown benchmark {name!r}; choose from "
                                f"{', '.join(benches)}")
    benches[name][0](fv)


def main(fv, args, argv) -> int:
    """Run the benchmark `args` names (`table` takes its file as the next argument)."""
    benches = commands()
    if not args:
        sys.stderr.write(_usage(benches))
        return EXIT_USAGE
    _ARGV[:] = argv
    name = args[0]
    return table(fv, args[1:]) if name == "table" else benches[name][1](fv)


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
    return _write_out(args.out, res)


def data(args) -> int:
    from jtrain.bench import data as bd  # imports JAX and torch

    if min(args.num_examples, args.batch_size, args.rounds, args.batches, args.steps) < 1 \
            or args.num_workers < 0 or args.num_examples < args.batch_size * (
                args.batches + bd.warmup_batches(max(args.num_workers, 0))):
        return _fail("error: sizes must be >= 1 (workers >= 0), and --num_examples must hold "
                     "--batches + the warm-up batches (1 + 2 per worker)")
    try:
        res = bd.run(n=args.num_examples, batch=args.batch_size, workers=args.num_workers,
                     rounds=args.rounds, batches=args.batches, steps=args.steps,
                     progress=lambda s: print(s, file=sys.stderr, flush=True))
    except ImportError as e:
        return _fail(f"error: {e} (the data bench needs torch: pip install 'jtrain[torch]')")
    print(bd.format_report(res), flush=True)
    return _write_out(args.out, res)


def peers(args) -> int:
    from jtrain.bench import peers as bp  # no JAX, no torch until a case runs

    missing = bp.missing_peers()
    if missing:
        return _fail(f"peers needs {', '.join(missing)} (pip install 'jtrain[bench]')")
    unknown = [c for c in args.cases if c not in bp.CASES]
    if unknown or args.rounds < 1 or (args.steps is not None and args.steps < 8):
        return _fail(f"error: --cases: choose from {', '.join(bp.CASES)} (got "
                     f"{', '.join(unknown) or 'ok'}); --rounds >= 1; --steps >= 8")
    print(f"command: {bp.command_line(args.cases, args.rounds, args.steps)}", flush=True)
    try:
        res = bp.run(args.cases, args.rounds, args.steps, args.workdir,
                     progress=lambda s: print(s, file=sys.stderr, flush=True))
    except bp.PeersError as e:
        return _fail(f"error: {e}")
    for case in res["cases"]:
        print(bp.format_case(case), flush=True)
    print(res["note"], flush=True)
    print(machine_lib.header_line(res["machine"]), flush=True)
    return _write_out(args.out, res)
