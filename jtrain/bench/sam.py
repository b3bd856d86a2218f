"""`python -m jtrain.bench sam`: the SAM recipe's step (jtrain/recipes/sam.py, two gradient
evaluations per update) against the built-in update of the same model and optimizer.

Both sides train the MLP of `jtrain.recipes.sam.model_section` with the AdamW of
`optim_section` on the breast-cancer split (`jtrain.train`, the same batches, no eval, no
checkpoints), in one process, sides alternating over `--rounds`. Each side's step time is
1 / summary.json's perf/steps_per_sec (the loop's steady state: the first log interval,
which holds compilation, left out). Reported: the median step time of each side, every
round's ratio, and the ratio of the medians (SAM / built-in), with the machine, commit and
load average (jtrain.bench.machine). Expected: about 2x (two forward-backward passes
instead of one, the same optimizer update); less where the step is bound by dispatch
rather than compute (small widths).
"""

from __future__ import annotations

import os
import statistics
import tempfile

from absl import flags


def define_flags(fv) -> None:
    flags.DEFINE_integer("steps", 400, "train steps per run", flag_values=fv)
    flags.DEFINE_integer("rounds", 3, "rounds (each: the built-in update, then SAM)",
                         flag_values=fv)
    flags.DEFINE_integer("hidden", 32, "MLP hidden width (two layers)", flag_values=fv)
    flags.DEFINE_integer("batch_size", 32, "examples per step", flag_values=fv)
    flags.DEFINE_string("out", None, "write the results as JSON to this file", flag_values=fv)


def _config(side: str, steps: int, hidden: int, batch_size: int) -> dict:
    from jtrain.recipes import sam

    cfg = {"total_steps": steps, "seed": 0, "data": {"batch_size": batch_size},
           "eval": {"every_steps": 0}, "checkpoint": {"every_steps": 0},
           "log": {"verbosity": 0, "every_steps": max(steps // 8, 1), "writers": ["jsonl"]},
           "compile": {"cache_dir": ""}}
    if side == "sam":
        return {**cfg, "step": {"factory": "jtrain.recipes.sam:make",
                                "kwargs": {"hidden": [hidden, hidden]}}}
    return {**cfg, "model": sam.model_section((hidden, hidden)), "optim": sam.optim_section()}


def run(steps: int, rounds: int, hidden: int, batch_size: int) -> dict:
    import jtrain
    from jtrain.bench import machine
    from jtrain.recipes import sam

    data = sam.make_data()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            row = {}
            for side in ("builtin", "sam"):
                res = jtrain.train(_config(side, steps, hidden, batch_size),
                                   os.path.join(tmp, f"{side}{r}"), train_data=data["train"])
                row[f"{side}_ms"] = 1e3 / res.summary["perf/steps_per_sec"]
                row[f"{side}_loss"] = res.history[-1].get("train/loss")
            row["ratio"] = row["sam_ms"] / row["builtin_ms"]
            row["loadavg"] = os.getloadavg()[0]
            rows.append(row)
    med = {k: statistics.median(r[k] for r in rows) for k in ("builtin_ms", "sam_ms")}
    return {"steps": steps, "hidden": hidden, "batch_size": batch_size, "rounds": rows,
            "median": med, "ratio": med["sam_ms"] / med["builtin_ms"],
            "cpu": machine.cpu_model(), "cores": machine.cores(), "commit": machine.commit(),
            "loadavg": os.getloadavg()}


def format_report(res: dict) -> str:
    m = res["median"]
    lines = [f"SAM vs the built-in update: MLP {res['hidden']}x{res['hidden']}, batch "
             f"{res['batch_size']}, {res['steps']} steps, {len(res['rounds'])} rounds",
             f"  {res['cpu']} ({res['cores']} cores), commit {res['commit']}"]
    for i, r in enumerate(res["rounds"]):
        lines.append(f"  round {i}: built-in {r['builtin_ms']:.3f} ms/step, SAM "
                     f"{r['sam_ms']:.3f} ms/step, ratio {r['ratio']:.2f} "
                     f"(load {r['loadavg']:.2f})")
    lines += [f"  median: built-in {m['builtin_ms']:.3f} ms/step, SAM {m['sam_ms']:.3f} "
              f"ms/step: SAM / built-in = {res['ratio']:.2f}x (expected about 2x)",
              "  load average     " + " ".join(f"{v:.2f}" for v in res["loadavg"])]
    return "\n".join(lines)


def main(args) -> int:
    import json

    if min(args.steps, args.rounds, args.hidden, args.batch_size) < 1 or args.steps < 16:
        print("error: --steps must be >= 16; --rounds, --hidden, --batch_size >= 1")
        return 2
    res = run(args.steps, args.rounds, args.hidden, args.batch_size)
    print(format_report(res), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return 0
