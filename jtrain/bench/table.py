"""`python -m jtrain.bench table FILE.json`: a benchmark's `--out` JSON as the markdown
tables of docs/benchmarks.md: medians with every round's value beside them, values
measured under a load above the core count marked `!`, and the machine, commit, date and
load range under each table.
"""

from __future__ import annotations

import json
import statistics

from jtrain.bench import machine as machine_lib


class TableError(ValueError):
    """The file is not a benchmark's --out JSON this command knows."""


def _v(fmt: str, x) -> str:
    return "n/a" if x is None or x != x else fmt.format(x)


def _cell(fmt: str, values: list, loads: list) -> str:
    """"median (round 1, round 2, ...)", a round under too much load marked !."""
    vals = [v for v in values if v is not None and v == v]
    med = _v(fmt, statistics.median(vals)) if vals else "n/a"
    if len(values) < 2:
        return med + machine_lib.mark(loads[0] if loads else None)
    rounds = ", ".join(_v(fmt, v) + machine_lib.mark(ld)
                       for v, ld in zip(values, loads, strict=True))
    return f"{med} ({rounds})"


def _footer(res: dict, loads: list) -> str:
    info = res.get("machine")
    where = (f"{info['date']}, jtrain `{info['commit'][:12]}`, {info['cpu_model']}, "
             f"{info['cores']} cores" if info else "machine not recorded")
    return f"{where}; {machine_lib.loads_line(loads, info and info['cores'])}."


def _command(res: dict) -> str:
    """The command that wrote the file (recorded by --out), else the benchmark's name."""
    return res.get("command") or f"python -m jtrain.bench {res.get('bench', '?')}"


def peers(res: dict) -> str:
    from jtrain.bench.peers import ROWS, SIDES  # no JAX, no torch

    out = []
    for case in res["cases"]:
        s = case["sides"]
        out += [f"**{case['case']}**: {case['steps']} steps, {case['rounds']} round(s) per "
                f"side, metric {case['metric']}, medians (per round)", "",
                "| | jtrain | torch | lightning | jtrain/torch | jtrain/lightning |",
                "|---|---|---|---|---|---|"]
        for label, key, fmt in ROWS:
            src = {"step_ms": "step_ms", "wall_s": "wall_s", "maxrss_mb": "maxrss_mb",
                   "faults": "faults"}.get(key)
            cells = []
            for side in SIDES:
                runs = s[side]["runs"]
                if src:
                    cells.append(_cell(fmt, [r[src] for r in runs],
                                       [r.get("load") for r in runs]))
                else:
                    cells.append(_v(fmt, s[side][key]) + machine_lib.mark(s[side]))
            j, t, lt = (s[x][key] for x in SIDES)
            ratios = [_v("{:.3f}", j / d if d else float("nan")) for d in (t, lt)]
            out.append(f"| {label} | " + " | ".join(cells + ratios) + " |")
        loads = [r.get("load") for x in SIDES for r in s[x]["runs"]]
        out += ["", f"`{_command(res)}`; {_footer(res, loads)}", ""]
    return "\n".join(out)


def overhead(res: dict) -> str:
    j, h = res["jtrain"], res["hand"]
    jl, hl = j.get("load", [None] * res["rounds"]), h.get("load", [None] * res["rounds"])
    return "\n".join([
        f"**overhead {res['model']}**: {res['rounds']} rounds x {res['steps']} steps, batch "
        f"{res['batch_size']} x {res['seq_len']}, {res['backend']}", "",
        "| | jtrain | hand-written `jax.jit` | jtrain/hand | goal |", "|---|---|---|---|---|",
        f"| ms/step, median (per round) | {_cell('{:.2f}', j['ms_per_step'], jl)} | "
        f"{_cell('{:.2f}', h['ms_per_step'], hl)} | {res['ratio']:.3f} | <= {res['goal']} |",
        "", f"`{_command(res)}`; {_footer(res, jl + hl)}", ""])


def data(res: dict) -> str:
    rows, loads = res["rows"], res.get("load", [None] * len(res["rows"]))
    col = {k: [r[k] for r in rows] for k in rows[0]}
    return "\n".join([
        f"**data**: batch {res['batch_size']}, {res['num_workers']} worker(s), "
        f"{res['rounds']} rounds", "",
        "| | jtrain | torch DataLoader / synthetic | ratio | goal |", "|---|---|---|---|---|",
        f"| examples/s | {_cell('{:,.0f}', col['jtrain_examples_per_sec'], loads)} | "
        f"{_cell('{:,.0f}', col['torch_examples_per_sec'], loads)} | "
        f"{res['examples_ratio']:.3f} | >= {res['goals']['examples']} |",
        f"| step ms (real data / synthetic) | {_cell('{:.2f}', col['real_ms_per_step'], loads)}"
        f" | {_cell('{:.2f}', col['synthetic_ms_per_step'], loads)} | "
        f"{res['step_ratio']:.3f} | <= {res['goals']['step']} |",
        "", f"`{_command(res)}`; {_footer(res, loads)}", ""])


KINDS = {"peers": peers, "overhead": overhead, "data": data}


def kind_of(res: dict) -> str:
    kind = res.get("bench") if isinstance(res, dict) else None
    if kind is None and isinstance(res, dict) and "cases" in res:
        kind = "peers"  # files written before peers recorded its name
    if kind not in KINDS:
        raise TableError(f"not a {'/'.join(KINDS)} benchmark's --out JSON (bench: {kind!r})")
    return kind


def markdown(path: str) -> str:
    try:
        with open(path) as f:
            res = json.load(f)
    except (OSError, ValueError) as e:
        raise TableError(f"{path}: {e}") from None
    try:
        return KINDS[kind_of(res)](res)
    except (KeyError, TypeError, IndexError) as e:
        raise TableError(f"{path}: missing or odd field {e}") from None
