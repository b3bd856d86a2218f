"""`python -m jtrain.bench peers`: the same work in jtrain, plain PyTorch and PyTorch
Lightning, each run a whole separate process, alternating sides round by round.

Cases: `mlp` (a 64-64 GELU MLP on scikit-learn's digits, the same split for all three:
jtrain reads the arrays (jtrain.bench.digits, no torch in its process), the PyTorch sides
a torch `Dataset` over them; batch 32, Adam 1e-3), `lm_debug` and `lm_base` (configs/base.py's
transformer at its debug and full size, jtrain.bench.peer_torch.TorchLM on the PyTorch sides, fed
the byte windows jtrain's pipeline yields, in the same order), `lm_tiny` (a 1-layer d=32 LM:
what the test suite runs). jtrain runs its own CLI (`python -m jtrain.main`, the user's
command); the PyTorch sides run `jtrain/bench/peer_torch.py` as a script (no jtrain or
JAX in that process). Everything on the CPU (`JAX_PLATFORMS=cpu`).

Per run: steady step time (the median over log intervals of `log_every` steps of the
mean time per step, the first interval and those holding an eval dropped; jtrain's from
its metrics.jsonl stamps, the PyTorch sides' from per-step stamps grouped the same way),
the whole process wall time for the same number of steps (launch to exit, start-up and
the final eval included; jtrain also writes its final checkpoint), the eval metric at the
last step (LM: eval loss on the same windows; MLP: eval accuracy), the time from launch
to the first eval reaching the target (the worst side's median metric at the half-way
eval, one value for all sides), and peak RSS and minor page faults (`wait4` rusage).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jtrain.bench import machine as machine_lib

PEER_SCRIPT = Path(__file__).with_name("peer_torch.py")
BASE_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "base.py"
SIDES = ("jtrain", "torch", "lightning")
NEEDED = {"torch": "torch", "lightning": "lightning", "sklearn": "scikit-learn"}
TINY_LM = {"model.d_model": 32, "model.num_layers": 1, "model.num_heads": 2,
           "model.d_ff": 64, "model.max_len": 32, "data.seq_len": 32, "data.batch_size": 8}


@dataclasses.dataclass
class Case:
    name: str
    steps: int  # default run length
    log_every: int
    variant: str = ""  # configs/base.py variant (LM cases)
    overrides: dict = dataclasses.field(default_factory=dict)
    eval_batches: int = 10

    @property
    def lm(self) -> bool:
        return self.name.startswith("lm")


CASES = {
    "mlp": Case("mlp", steps=600, log_every=10),
    "lm_tiny": Case("lm_tiny", steps=40, log_every=5, variant="debug", overrides=TINY_LM,
                    eval_batches=4),
    "lm_debug": Case("lm_debug", steps=150, log_every=10, variant="debug"),
    "lm_base": Case("lm_base", steps=40, log_every=5, eval_batches=5),
}
MLP_CONFIG = '''from jtrain.config import defaults


def get_config():
    config = defaults(model="mlp")
    config.model.hidden = (64, 64)
    config.model.num_outputs = 10
    config.data.source = "jtrain.bench.digits:digits"
    config.data.batch_size = 32
    config.optim.name = "adamw"
    config.optim.lr = 1e-3
    config.optim.schedule = "constant"
    config.optim.weight_decay = 0.0
    config.optim.clip_norm = 0.0
    return config
'''


class PeersError(RuntimeError):
    """A side failed or produced no result; one line."""


def missing_peers() -> list[str]:
    return [pip for mod, pip in NEEDED.items() if importlib.util.find_spec(mod) is None]


def _fmt(v) -> str:
    return repr(v) if not isinstance(v, str) else v


def run_plan(case: Case, steps: int, workroot: Path) -> dict:
    """The run's settings, the jtrain command line, and the PyTorch sides' spec file."""
    # 4 evals; at least 2 log intervals apart, so clean (eval-free) intervals remain.
    eval_every = max(2 * case.log_every, (steps // 4) // case.log_every * case.log_every)
    steps = eval_every * 4
    over = dict(case.overrides)
    over.update({"total_steps": steps, "log.every_steps": case.log_every,
                 "eval.every_steps": eval_every, "checkpoint.every_steps": 0,
                 "log.writers": ("jsonl",)})
    if case.lm:
        config_arg = f"{BASE_CONFIG}" + (f":{case.variant}" if case.variant else "")
        over["eval.num_batches"] = case.eval_batches
    else:
        (workroot / "mlp_config.py").write_text(MLP_CONFIG)
        config_arg = str(workroot / "mlp_config.py")
    cfg = _resolved(config_arg, over, case.lm)
    if case.lm:
        over["optim.warmup_steps"] = cfg.optim.warmup_steps
    spec = {"case": "lm" if case.lm else "mlp", "steps": steps, "seed": cfg.seed,
            "batch": cfg.data.batch_size, "log_every": case.log_every,
            "eval_every": eval_every, "mlp_hidden": list(cfg.model.get("hidden", ())),
            "optim": {k: cfg.optim[k] for k in ("lr", "weight_decay", "clip_norm",
                                                  "warmup_steps", "schedule")}}
    if case.lm:
        spec["lm"] = {k: cfg.model[k] for k in ("d_model", "num_layers", "num_heads", "d_ff")}
        spec.update(_dump_windows(cfg, steps, case.eval_batches, workroot))
    spec_path = workroot / "spec.json"
    spec_path.write_text(json.dumps(spec))
    flags = [f"--config={config_arg}"] + [f"--config.{k}={_fmt(v)}" for k, v in over.items()]
    return {"steps": steps, "eval_every": eval_every, "spec": str(spec_path),
            "jtrain_args": flags, "metric": "eval/loss" if case.lm else "eval/accuracy"}


def _resolved(config_arg: str, over: dict, lm: bool):
    from jtrain import config as config_lib

    path, _, variant = config_arg.partition(":") if lm else (config_arg, "", "")
    spec = importlib.util.spec_from_file_location("jtrain_peers_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config(variant) if lm else module.get_config()
    for key, value in over.items():
        section, _, name = key.rpartition(".")
        (cfg[section] if section else cfg)[name] = value
    if lm:  # the same clamp for every side: the warmup fits in a short run
        cfg.optim.warmup_steps = min(cfg.optim.warmup_steps, max(1, cfg.total_steps // 10))
    return config_lib.resolve(cfg)


def _dump_windows(cfg, steps: int, eval_batches: int, workroot: Path) -> dict:
    """jtrain's first `steps` training batches and its eval examples as [N, T+1] bytes."""
    import numpy as np

    from jtrain import data as data_lib
    from jtrain.bench.overhead import iterator_kwargs

    train, ev, _ = data_lib.make_sources(cfg.data)
    it = data_lib.make_train_iterator(train, **iterator_kwargs(cfg))

    def windows(batches):
        return np.concatenate([np.concatenate([np.asarray(b["inputs"]),
                                               np.asarray(b["targets"])[:, -1:]], axis=1)
                               for b in batches]).astype(np.uint8)
    train_w = windows(next(it) for _ in range(steps))
    n_eval = eval_batches * (cfg.eval.batch_size or cfg.data.batch_size)
    eval_w = windows([_stack(ev.source, n_eval)])
    np.save(workroot / "train_windows.npy", train_w)
    np.save(workroot / "eval_windows.npy", eval_w)
    return {"train_windows": str(workroot / "train_windows.npy"),
            "eval_windows": str(workroot / "eval_windows.npy")}


def _stack(source, n: int) -> dict:
    import numpy as np

    items = [source.read(i) for i in range(min(n, len(source)))]
    return {k: np.stack([np.asarray(x[k]) for x in items]) for k in ("inputs", "targets")}


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JTRAIN_FAULT")}
    env["JAX_PLATFORMS"] = "cpu"
    return env


def launch(cmd: list[str], cwd: Path, log: Path, timeout: float) -> dict:
    """Runs one side to exit: wall time, peak RSS and minor faults (wait4), the output."""
    loads = [machine_lib.loadavg()]
    with open(log, "w") as out:
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=_env())
        deadline, next_load = t0 + timeout, t0 + 1.0
        while True:
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.time() >= next_load:  # the load while the side runs, once a second
                loads.append(machine_lib.loadavg())
                next_load += 1.0
            if time.time() > deadline:
                proc.kill()
                pid, status, ru = os.wait4(proc.pid, 0)
                break
            time.sleep(0.02)
        wall = time.time() - t0
    loads.append(machine_lib.loadavg())
    proc.returncode = os.waitstatus_to_exitcode(status)
    text = log.read_text(errors="replace")
    if proc.returncode != 0:
        tail = " | ".join(text.strip().splitlines()[-3:])
        raise PeersError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}: {tail}")
    return {"t0": t0, "wall_s": wall, "maxrss_mb": ru.ru_maxrss / 1024,
            "minflt": ru.ru_minflt, "output": text, "load": machine_lib.load_record(loads)}


def _blocks(stamps: list[tuple[int, float]], log_every: int, eval_steps: set) -> list:
    """ms/step per log interval from (step, time) stamps at interval ends; the first
    interval (compilation, warm-up) and the intervals right after an eval dropped."""
    out = []
    for (s0, t0), (s1, t1) in zip(stamps, stamps[1:], strict=False):  # neighbours
        if s0 >= log_every and s0 not in eval_steps:  # an eval at s0 runs after its stamp
            out.append(1e3 * (t1 - t0) / (s1 - s0))
    return out


def measure_jtrain(plan: dict, case: Case, workroot: Path, index: int) -> dict:
    workdir = workroot / f"jtrain_{index}"
    shutil.rmtree(workdir, ignore_errors=True)
    cmd = [sys.executable, "-m", "jtrain.main", *plan["jtrain_args"], f"--workdir={workdir}"]
    res = launch(cmd, workroot, workroot / f"jtrain_{index}.log", timeout=3600)
    recs = [json.loads(x) for x in open(workdir / "metrics.jsonl")]
    logs = [(r["step"], r["time"]) for r in recs if "train/loss" in r]
    evals = [(r["step"], r["time"], r[plan["metric"]]) for r in recs if plan["metric"] in r]
    losses = [r["train/loss"] for r in recs if "train/loss" in r]
    shutil.rmtree(workdir, ignore_errors=True)
    return _sample(res, logs, evals, losses, plan, case)


def measure_torch(side: str, plan: dict, case: Case, workroot: Path, index: int) -> dict:
    spec = json.loads(Path(plan["spec"]).read_text())
    spec["side"] = side
    spec_path = workroot / f"{side}_{index}.json"
    spec_path.write_text(json.dumps(spec))
    res = launch([sys.executable, str(PEER_SCRIPT), str(spec_path)], workroot,
                 workroot / f"{side}_{index}.log", timeout=3600)
    line = [x for x in res["output"].splitlines() if x.startswith("PEER_RESULT ")]
    if not line:
        raise PeersError(f"{side}: no result line in its output")
    rec = json.loads(line[-1][len("PEER_RESULT "):])
    ends = rec["step_end"]
    logs = [(s, ends[s - 1]) for s in range(case.log_every, len(ends) + 1, case.log_every)]
    return _sample(res, logs, [tuple(e) for e in rec["evals"]], rec["losses"], plan, case)


def _sample(res, logs, evals, losses, plan, case) -> dict:
    eval_steps = {s for s, _, _ in evals}
    blocks = _blocks(logs, case.log_every, eval_steps)
    return {"wall_s": res["wall_s"], "maxrss_mb": res["maxrss_mb"], "load": res["load"],
            "unreliable": res["load"]["unreliable"],
            "faults": res["minflt"], "steps": logs[-1][0] if logs else 0,
            "step_ms": statistics.median(blocks) if blocks else float("nan"),
            "evals": [(s, t - res["t0"], m) for s, t, m in evals],
            "first_loss": losses[0] if losses else float("nan"),
            "last_loss": losses[-1] if losses else float("nan")}


def run_case(case: Case, steps: int, rounds: int, workroot: Path, progress) -> dict:
    workroot.mkdir(parents=True, exist_ok=True)
    plan = run_plan(case, steps, workroot)
    runs = {side: [] for side in SIDES}
    for r in range(rounds):
        order = SIDES[r % 3:] + SIDES[:r % 3]  # who goes first rotates
        for side in order:
            progress(f"peers {case.name}: round {r + 1}/{rounds}, {side}")
            if side == "jtrain":
                runs[side].append(measure_jtrain(plan, case, workroot, r))
            else:
                runs[side].append(measure_torch(side, plan, case, workroot, r))
    return summarize(case, plan, runs)


def summarize(case: Case, plan: dict, runs: dict) -> dict:
    higher = not case.lm  # accuracy: higher is better
    half = plan["eval_every"] * 2
    at_half = {side: statistics.median([m for run in rs for s, _, m in run["evals"]
                                        if s == half]) for side, rs in runs.items()}
    target = min(at_half.values()) if higher else max(at_half.values())
    sides = {}
    for side, rs in runs.items():
        def reach(run):
            hit = [t for _, t, m in run["evals"] if (m >= target if higher else m <= target)]
            return min(hit) if hit else float("nan")
        sides[side] = {
            "step_ms": statistics.median(r["step_ms"] for r in rs),
            "wall_s": statistics.median(r["wall_s"] for r in rs),
            "final_metric": statistics.median(r["evals"][-1][2] for r in rs),
            "time_to_target_s": statistics.median(reach(r) for r in rs),
            "maxrss_mb": statistics.median(r["maxrss_mb"] for r in rs),
            "faults": statistics.median(r["faults"] for r in rs),
            "steps": [r["steps"] for r in rs], "runs": rs,
            "unreliable": machine_lib.any_unreliable(r["load"] for r in rs)}
    return {"case": case.name, "steps": plan["steps"], "rounds": len(runs["jtrain"]),
            "unreliable": any(s["unreliable"] for s in sides.values()),
            "metric": plan["metric"], "target": target, "sides": sides,
            "jtrain_command": shlex.join(["python", "-m", "jtrain.main", *plan["jtrain_args"]])}


ROWS = (("step ms", "step_ms", "{:.2f}"), ("wall s", "wall_s", "{:.1f}"),
        ("final metric", "final_metric", "{:.4f}"), ("to target s", "time_to_target_s",
                                                      "{:.1f}"),
        ("peak RSS MB", "maxrss_mb", "{:.0f}"), ("page faults", "faults", "{:.0f}"))


def format_case(res: dict) -> str:
    s = res["sides"]
    lines = [f"{res['case']}: {res['steps']} steps, {res['rounds']} rounds per side, "
             f"metric {res['metric']} (target {res['target']:.4f}), medians over rounds",
             f"  {'':<14}{'jtrain':>11}{'torch':>11}{'lightning':>11}"
             f"{'j/torch':>9}{'j/light':>9}"]
    marks = [machine_lib.mark(s[x]) for x in SIDES]
    for label, key, fmt in ROWS:
        j, t, lt = (s[x][key] for x in SIDES)
        lines.append(f"  {label:<14}" + "".join(f"{fmt.format(v) + m:>11}"
                                                for v, m in zip((j, t, lt), marks, strict=True))
                     + f"{j / t if t else float('nan'):>9.3f}"
                     + f"{j / lt if lt else float('nan'):>9.3f}")
    lines.append("  " + machine_lib.loads_line([r["load"] for x in SIDES
                                                for r in s[x]["runs"]]))
    lines.append(f"  jtrain's command: {res['jtrain_command']}")
    return "\n".join(lines)


def command_line(cases, rounds, steps) -> str:
    line = f"python -m jtrain.bench peers --cases={','.join(cases)} --rounds={rounds}"
    return line + (f" --steps={steps}" if steps else "")


def run(cases, rounds: int, steps: int | None, workdir: str | None, progress) -> dict:
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="jtrain_peers_"))
    info = machine_lib.machine()
    try:
        results = [run_case(CASES[c], steps or CASES[c].steps, rounds, root / c, progress)
                   for c in cases]
    finally:
        if not workdir:
            shutil.rmtree(root, ignore_errors=True)
    return {"bench": "peers", "command": command_line(cases, rounds, steps), "cases": results,
            "machine": info,
            "note": "CPU only (JAX_PLATFORMS=cpu); each side a separate process, sides "
                    "alternating, first side rotating per round"}
