"""`python -m jtrain.bench async_eval`: a run with frequent evaluation without evals,
with eval.mode=sync and with eval.mode=async, side by side.

Every side runs `python -m jtrain.main --config=base:debug` (eval every `--every` steps
over `--eval_batches` batches; `none`: one eval at the end) as its own process, sides in
turn, `--rounds` times; `async` runs its evaluator at `--nice` on `--cpus` CPUs,
`async_nice0` at nice 0. Per side (medians): `step` (the goodput ledger's step time),
`waited` (in evals, or waiting for the evaluator), `saves`, `first stall` (the wall time
of the first step that applies an async eval: the evaluator's start-up), `loop` (wall
time per step after it, evals and waits included), `cpu` (the training process's own
CPU per step over that window: what load distorts least), `evaluator` (the CPU of the
children) and `wall`. The load average is recorded around every side
(jtrain/bench/machine.py).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from absl import flags

from jtrain.bench import machine

SIDES = ("none", "sync", "async", "async_nice0")
HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
KEYS = ("step_ms", "waited_s", "saves_s", "first_stall_s", "loop_ms", "cpu_ms",
        "evaluator_cpu_s", "wall_s")


def define_flags(fv) -> None:
    flags.DEFINE_integer("steps", 100, "train steps per run", flag_values=fv)
    flags.DEFINE_integer("every", 10, "eval.every_steps", flag_values=fv)
    flags.DEFINE_integer("eval_batches", 10, "eval.num_batches", flag_values=fv)
    flags.DEFINE_integer("lag", 1, "eval.async_lag", flag_values=fv)
    flags.DEFINE_integer("nice", 19, "JTRAIN_EVAL_NICE of the async side", flag_values=fv)
    flags.DEFINE_integer("cpus", 0, "JTRAIN_EVAL_CPUS of the async sides", flag_values=fv)
    flags.DEFINE_list("sides", ["none", "sync", "async"], f"sides, of {', '.join(SIDES)}",
                      flag_values=fv)
    flags.DEFINE_integer("rounds", 2, "rounds (each runs every side once)", flag_values=fv)
    flags.DEFINE_string("out", None, "write the results as JSON to this file", flag_values=fv)


def _command(workdir: str, side: str, a: dict) -> list[str]:
    base = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "configs", "base.py")
    every = 0 if side == "none" else a["every"]
    mode = "async" if side.startswith("async") else "sync"
    return [sys.executable, "-m", "jtrain.main", f"--config={base}:debug",
            f"--workdir={workdir}", f"--config.total_steps={a['steps']}",
            f"--config.eval.every_steps={every}", f"--config.eval.num_batches={a['eval_batches']}",
            f"--config.eval.mode={mode}", f"--config.eval.async_lag={a['lag']}",
            f"--config.log.every_steps={a['every']}", "--config.checkpoint.every_steps=0",
            "--config.log.writers=jsonl"]


def _own_cpu(pid: int) -> float | None:
    """The process's own user + sys seconds (not its children's)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / HZ


def _step_of(workdir: str) -> int:
    """The loop's step: the head of the goodput ledger's line (written after each step)."""
    try:
        with open(os.path.join(workdir, "goodput.jsonl"), "rb") as f:
            return int(f.read(20).split(b":")[1])
    except (OSError, ValueError, IndexError):
        return 0


def _sampled(proc: subprocess.Popen, workdir: str, watch: machine.LoadWatch) -> list:
    """(time, step, own CPU seconds) of the training process every 20 ms until it ends."""
    samples: list[tuple[float, int, float]] = []
    last_load = time.monotonic()
    while proc.poll() is None:
        cpu = _own_cpu(proc.pid)
        if cpu is not None:
            samples.append((time.perf_counter(), _step_of(workdir), cpu))
        if time.monotonic() - last_load > 1.0:
            watch.sample()
            last_load = time.monotonic()
        time.sleep(0.02)
    return samples


def _window(samples: list, lo: int, hi: int) -> tuple[float, float]:
    """(wall, CPU) seconds per step between the first samples at steps >= lo and >= hi."""
    first = next(s for s in samples if s[1] >= lo)
    last = next(s for s in samples if s[1] >= hi)
    n = last[1] - first[1]
    return (last[0] - first[0]) / n, (last[2] - first[2]) / n


def _stall(samples: list, step: int) -> float:
    """The wall seconds from the last sample before `step` to the first after it."""
    before = [s for s in samples if s[1] < step]
    after = next(s for s in samples if s[1] > step)
    return after[0] - (before[-1][0] if before else samples[0][0])


def _one(workdir: str, side: str, a: dict) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with machine.LoadWatch(thread=False) as watch:
        t0 = time.perf_counter()
        with open(os.path.join(os.path.dirname(workdir), side + ".log"), "w") as log:
            nice = 0 if side == "async_nice0" else a["nice"]  # the child evaluator's
            proc = subprocess.Popen(_command(workdir, side, a), stdout=log, env={
                **os.environ, "JTRAIN_EVAL_NICE": str(nice), "JTRAIN_EVAL_CPUS": str(a["cpus"])},
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            samples = _sampled(proc, workdir, watch)
        wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        tails = []
        for path in (log.name, os.path.join(workdir, "evals", "evaluator.log")):
            if os.path.exists(path):
                with open(path) as f:
                    tails.append(f.read().strip()[-600:])
        raise RuntimeError(f"the {side} run failed: {' | '.join(tails)}")
    with open(os.path.join(workdir, "summary.json")) as f:
        seconds = json.load(f)["goodput"]["seconds"]
    first_applied = (a["lag"] + 1) * a["every"]  # async: waits for the evaluator's start
    last_point = (a["steps"] - 1) // a["every"] * a["every"]  # its eval inside the window
    loop, cpu = _window(samples, first_applied + 1, last_point + 1)
    stall = _stall(samples, first_applied)
    total_cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"step_ms": 1e3 * seconds["productive"] / (a["steps"] - 1),  # after step 1
            "waited_s": seconds["eval"], "saves_s": seconds["checkpoints"],
            "loop_ms": 1e3 * loop, "cpu_ms": 1e3 * cpu, "first_stall_s": stall,
            "evaluator_cpu_s": max(0.0, total_cpu - samples[-1][2]), "wall_s": wall,
            "load": watch.record}


def run(a: dict) -> dict:
    info = machine.machine()
    rows: dict[str, list] = {side: [] for side in a["sides"]}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a["rounds"]):
            order = a["sides"][r % len(a["sides"]):] + a["sides"][:r % len(a["sides"])]
            for side in order:
                os.makedirs(os.path.join(tmp, f"{side}{r}"))
                rows[side].append(_one(os.path.join(tmp, f"{side}{r}", "run"), side, a))
    med = {side: {k: statistics.median(x[k] for x in rows[side]) for k in KEYS}
           for side in rows}
    return {**a, "machine": info, "rounds_data": rows, "median": med,
            "command": f"JTRAIN_EVAL_NICE={a['nice']} JTRAIN_EVAL_CPUS={a['cpus']} "
                       + " ".join(_command("WORKDIR", "SIDE", a)[1:])}


def _extra(res: dict, side: str) -> str:
    """Where a side's loop time beyond the no-eval side's went, per step."""
    m, n = res["median"], res["steps"]
    base, s = m["none"], m[side]
    parts = {"evals or waits": 1e3 * s["waited_s"] / n, "saves": 1e3 * s["saves_s"] / n,
             "slower steps": s["step_ms"] - base["step_ms"]}
    most = max(parts, key=lambda k: parts[k])
    spelled = ", ".join(f"{k} {v:+.1f} ms" for k, v in parts.items())
    return (f"  {side}: steady loop {s['loop_ms'] - base['loop_ms']:+.1f} ms/step, trainer "
            f"CPU {s['cpu_ms'] - base['cpu_ms']:+.1f} ms/step vs none; whole run per step: "
            f"{spelled}; most: {most}")


def format_report(res: dict) -> str:
    m, sides = res["median"], list(res["median"])
    rounds = len(res["rounds_data"][sides[0]])
    rows = [("step (loop's own, ms)", "step_ms", "{:.1f}"),
            ("waited in evals (s)", "waited_s", "{:.2f}"),
            ("blocked in saves (s)", "saves_s", "{:.2f}"),
            ("first stall (s)", "first_stall_s", "{:.2f}"),
            ("steady loop wall/step (ms)", "loop_ms", "{:.1f}"),
            ("steady trainer CPU/step (ms)", "cpu_ms", "{:.1f}"),
            ("evaluator CPU (s)", "evaluator_cpu_s", "{:.1f}"),
            ("wall, whole process (s)", "wall_s", "{:.1f}")]
    marks = {side: machine.mark({"unreliable": any(
        x["load"].get("unreliable") for x in res["rounds_data"][side])}) for side in sides}
    lines = [machine.header_line(res["machine"]),
             f"eval every {res['every']} steps ({res['eval_batches']} batches), "
             f"{res['steps']} steps, configs/base.py:debug, async lag {res['lag']}, "
             f"evaluator nice {res['nice']} cpus {res['cpus'] or 'all'}; medians of "
             f"{rounds} rounds",
             f"  {'':27}" + "".join(f"{side + marks[side]:>13}" for side in sides)]
    for label, key, fmt in rows:
        lines.append(f"  {label:27}" + "".join(f"{fmt.format(m[s][key]):>13}" for s in sides))
    if "none" in m:
        lines += [_extra(res, s) for s in sides if s != "none"]
    lines.append("  " + machine.loads_line([x["load"] for side in sides
                                            for x in res["rounds_data"][side]]))
    return "\n".join(lines)


def main(args) -> int:
    if min(args.steps, args.every, args.eval_batches, args.rounds, args.lag) < 1 \
            or args.steps < (args.lag + 3) * args.every or not 0 <= args.nice <= 19 \
            or args.cpus < 0:
        print("error: --steps >= (--lag + 3) * --every; --every, --eval_batches, --rounds, "
              "--lag >= 1; --nice in [0, 19]; --cpus >= 0")
        return 2
    unknown = [s for s in args.sides if s not in SIDES]
    if unknown or not args.sides:
        print(f"error: --sides: {', '.join(unknown) or 'none given'}; choose from "
              f"{', '.join(SIDES)}")
        return 2
    a = {k: getattr(args, k) for k in ("steps", "every", "eval_batches", "lag", "nice",
                                       "cpus", "rounds")}
    a["sides"] = list(dict.fromkeys(args.sides))
    try:
        res = run(a)
    except RuntimeError as e:
        print(f"error: {e}")
        return 1
    print(format_report(res), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return 0
