"""`python -m jtrain.bench population`: K runs one after another vs one population of K.

Both sides train the same small MLP classifier (jtrain.train, numpy data, the same
steps and batches; the K single runs use the members' seeds and learning rates), in one
process, sides alternating over `--rounds`. Reported per side: the wall time of the
whole training (set-up and compile included) and steps/s of the loop (summary.json's
perf/steps_per_sec, the K runs' steps over their summed step time), and the compiled
train step's memory (`memory_analysis()`: arguments + temporaries, per device). The
ratios are of medians measured side by side; the load average is recorded with them.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from absl import flags


def define_flags(fv) -> None:
    flags.DEFINE_integer("size", 4, "members K", flag_values=fv)
    flags.DEFINE_integer("steps", 200, "train steps per run", flag_values=fv)
    flags.DEFINE_integer("rounds", 3, "rounds (each: K single runs, then a population)",
                         flag_values=fv)
    flags.DEFINE_integer("hidden", 64, "MLP hidden width", flag_values=fv)
    flags.DEFINE_string("out", None, "write the results as JSON to this file", flag_values=fv)


def _config(steps: int, hidden: int, **over) -> dict:
    return {"total_steps": steps, "seed": 0, "model": {"name": "mlp", "hidden": [hidden,
            hidden], "num_outputs": 4}, "data": {"batch_size": 32},
            "eval": {"every_steps": 0}, "checkpoint": {"every_steps": 0},
            "log": {"verbosity": 0, "every_steps": max(steps // 4, 1), "writers": ["jsonl"]},
            "optim": {"name": "adamw", "lr": 1e-3, "schedule": "constant"},
            "compile": {"cache_dir": ""}, **over}


def _data(n: int = 2048):
    import numpy as np

    r = np.random.default_rng(0)
    x = r.normal(size=(n, 16)).astype(np.float32)
    return {"inputs": x, "targets": (x[:, :2] > 0).astype(np.int32) @ np.array([1, 2])}


def _step_bytes(cfg: dict, data: dict) -> int:
    import jax
    import jtrain

    b = jtrain.build(jtrain.resolve(cfg), sample=data["inputs"][0],
                     eval_example={k: v[0] for k, v in data.items()})
    batch = {k: jax.ShapeDtypeStruct((32, *v.shape[1:]), v.dtype) for k, v in data.items()}
    mem = b.train_step.lower(b.abstract_with_shardings(), batch).compile().memory_analysis()
    return int(mem.argument_size_in_bytes + mem.temp_size_in_bytes) if mem else -1


def run(size: int, steps: int, rounds: int, hidden: int) -> dict:
    import jtrain

    data = _data()
    lrs = [1e-3 * (i + 1) for i in range(size)]
    population = {"size": size, "vary": {"optim.lr": lrs}}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            t0, step_time = time.perf_counter(), 0.0
            for i in range(size):
                cfg = _config(steps, hidden, seed=i)
                cfg["optim"]["lr"] = lrs[i]
                res = jtrain.train(cfg, os.path.join(tmp, f"r{r}s{i}"), train_data=data)
                step_time += steps / res.summary["perf/steps_per_sec"]
            single = time.perf_counter() - t0
            t0 = time.perf_counter()
            res = jtrain.train(_config(steps, hidden, population=population),
                               os.path.join(tmp, f"r{r}p"), train_data=data)
            rows.append({"single_wall_s": single, "population_wall_s": time.perf_counter() - t0,
                         "single_steps_per_sec": size * steps / step_time,
                         "population_member_steps_per_sec":
                             size * res.summary["perf/steps_per_sec"]})
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return {"size": size, "steps": steps, "rounds": rows, "median": med,
            "wall_ratio": med["single_wall_s"] / med["population_wall_s"],
            "throughput_ratio": med["population_member_steps_per_sec"]
            / med["single_steps_per_sec"],
            "step_bytes_single": _step_bytes(_config(steps, hidden), data),
            "step_bytes_population": _step_bytes(
                _config(steps, hidden, population=population), data),
            "loadavg": os.getloadavg()}


def format_report(res: dict) -> str:
    m = res["median"]
    return "\n".join([
        f"population of {res['size']} vs {res['size']} runs one after another, "
        f"{res['steps']} steps each, {len(res['rounds'])} rounds (medians)",
        f"  wall time        single runs {m['single_wall_s']:.2f} s, population "
        f"{m['population_wall_s']:.2f} s: {res['wall_ratio']:.2f}x faster",
        f"  member-steps/s   single runs {m['single_steps_per_sec']:.1f}, population "
        f"{m['population_member_steps_per_sec']:.1f}: {res['throughput_ratio']:.2f}x",
        f"  step memory      one run {res['step_bytes_single']:,} B, population "
        f"{res['step_bytes_population']:,} B (arguments + temporaries)",
        "  load average     " + " ".join(f"{v:.2f}" for v in res["loadavg"])])


def main(args) -> int:
    import json

    if min(args.size, args.steps, args.rounds, args.hidden) < 1 or args.size < 2:
        print("error: --size must be >= 2; --steps, --rounds, --hidden >= 1")
        return 2
    res = run(args.size, args.steps, args.rounds, args.hidden)
    print(format_report(res), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return 0
