"""`python -m jtrain.bench async_eval`: a run with frequent evaluation, eval.mode=sync
vs eval.mode=async, side by side.

Both sides run the same command (`python -m jtrain.main`, configs/base.py:debug: the
small byte-level LM, eval every `--every` steps over `--eval_batches` batches, no early
stopping so both do the same steps) as separate processes, sides alternating over
`--rounds`. Reported per side (medians): the loop's time per step (from the first to
the last log record of metrics.jsonl, over the steps between: a sync eval's time is
inside it, an async one's is not unless the loop waited), the wall time of the whole
process, and the CPU seconds (user + sys) of the process and its children (the async
side's evaluator included), from getrusage. The load average is recorded before and
after: on a machine busy with other work the wall times mean little.
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

SIDES = ("sync", "async")


def define_flags(fv) -> None:
    flags.DEFINE_integer("steps", 100, "train steps per run", flag_values=fv)
    flags.DEFINE_integer("every", 10, "eval.every_steps", flag_values=fv)
    flags.DEFINE_integer("eval_batches", 10, "eval.num_batches", flag_values=fv)
    flags.DEFINE_integer("rounds", 2, "rounds (each: a sync run, then an async run)",
                         flag_values=fv)
    flags.DEFINE_string("out", None, "write the results as JSON to this file", flag_values=fv)


def _command(workdir: str, mode: str, steps: int, every: int, batches: int) -> list[str]:
    base = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "configs", "base.py")
    return [sys.executable, "-m", "jtrain.main", f"--config={base}:debug",
            f"--workdir={workdir}", f"--config.total_steps={steps}",
            f"--config.eval.every_steps={every}", f"--config.eval.num_batches={batches}",
            f"--config.eval.mode={mode}", f"--config.log.every_steps={every}",
            "--config.checkpoint.every_steps=0", "--config.log.writers=jsonl"]


def _one(workdir: str, mode: str, steps: int, every: int, batches: int) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(_command(workdir, mode, steps, every, batches),
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise RuntimeError(f"the {mode} run failed: {proc.stderr.strip()[-500:]}")
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        logs = [r for r in map(json.loads, f) if "train/loss" in r]
    first, last = logs[0], logs[-1]
    return {"step_ms": 1e3 * (last["time"] - first["time"]) / (last["step"] - first["step"]),
            "wall_s": wall,
            "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)}


def run(steps: int, every: int, batches: int, rounds: int) -> dict:
    loads = [os.getloadavg()[0]]
    rows: dict[str, list] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for side in SIDES:
                rows[side].append(_one(os.path.join(tmp, f"{side}{r}"), side, steps, every,
                                       batches))
                loads.append(os.getloadavg()[0])
    med = {side: {k: statistics.median(x[k] for x in rows[side]) for k in rows[side][0]}
           for side in SIDES}
    return {"steps": steps, "every": every, "eval_batches": batches, "rounds": rows,
            "median": med, "loadavg": loads, "cores": os.cpu_count(),
            "command": " ".join(_command("WORKDIR", "MODE", steps, every, batches)[1:])}


def format_report(res: dict) -> str:
    m = res["median"]
    s, a = m["sync"], m["async"]
    return "\n".join([
        f"eval.mode sync vs async, configs/base.py:debug, {res['steps']} steps, eval every "
        f"{res['every']} steps ({res['eval_batches']} batches), {len(res['rounds']['sync'])} "
        "rounds (medians)",
        f"  loop time per step  sync {s['step_ms']:.1f} ms, async {a['step_ms']:.1f} ms: "
        f"{s['step_ms'] / a['step_ms']:.2f}x",
        f"  wall time           sync {s['wall_s']:.1f} s, async {a['wall_s']:.1f} s",
        f"  CPU seconds         sync {s['cpu_s']:.1f}, async {a['cpu_s']:.1f} (the "
        "evaluator process included)",
        f"  load average        {' '.join(f'{v:.2f}' for v in res['loadavg'])} on "
        f"{res['cores']} cores"])


def main(args) -> int:
    if min(args.steps, args.every, args.eval_batches, args.rounds) < 1:
        print("error: --steps, --every, --eval_batches and --rounds must be >= 1")
        return 2
    try:
        res = run(args.steps, args.every, args.eval_batches, args.rounds)
    except RuntimeError as e:
        print(f"error: {e}")
        return 1
    print(format_report(res), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return 0
