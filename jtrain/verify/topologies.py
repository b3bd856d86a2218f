"""`jtrain train --config=... --workdir=DIR --verify_topologies=1,2,8`: proof that a run
gives the same bits on several device counts (determinism.topology_invariant).

Runs the same command once per device count, each a separate process on that many fake
CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N), into DIR/devices_N,
with the mode on and a state hash recorded every step (debug.hash_every_steps=1). Then
compares hashes.jsonl step by step (the state hash and the step's example indices) and
the eval results in metrics.jsonl against the first count, and prints one line:
  jtrain: verify_topologies: PASS: ...   (exit 0)
  jtrain: verify_topologies: FAIL: ...   (exit 1)

`--verify_negative_control` runs the same with the mode off: the check must then FAIL,
which shows it can see the device count in the bits.
"""

from __future__ import annotations

import os
import sys

from jtrain.observe import runfiles
from jtrain.verify import resume

TIMEOUT_S = 3600
DROP = ("--workdir", "--verify_topologies", "--verify_negative_control",
        "--noverify_negative_control")


def _lines(path: str) -> list[dict]:
    try:
        return runfiles.read_ledger(path)
    except FileNotFoundError:
        return []


def _evals(workdir: str) -> list[dict]:
    return [{k: v for k, v in r.items() if k.startswith("eval/")}
            for r in _lines(os.path.join(workdir, "metrics.jsonl"))
            if any(k.startswith("eval/") for k in r)]


def compare(workdirs: dict[int, str]) -> tuple[bool, str]:
    """(ok, the verdict's text) for runs {device count: workdir}, the first the reference."""
    counts = list(workdirs)
    ref = _lines(os.path.join(workdirs[counts[0]], "hashes.jsonl"))
    if not ref:
        return False, f"no hashes.jsonl in {workdirs[counts[0]]}"
    for n in counts[1:]:
        rows = _lines(os.path.join(workdirs[n], "hashes.jsonl"))
        if [r["step"] for r in rows] != [r["step"] for r in ref]:
            return False, (f"{_n(n)} recorded steps {[r['step'] for r in rows]}, "
                           f"{_n(counts[0])} {[r['step'] for r in ref]}")
        for a, b in zip(ref, rows, strict=True):
            if a["hash"] != b["hash"] or a.get("examples") != b.get("examples"):
                parts = sorted(k for k in a.get("parts", {})
                               if a["parts"][k] != b.get("parts", {}).get(k))
                what = ("the example indices" if a["hash"] == b["hash"] else
                        f"the state hash ({', '.join(parts) or 'rest'})")
                return False, (f"{_n(n)} differ from {_n(counts[0])} at step "
                               f"{a['step']}: {what}")
        if _evals(workdirs[n]) != _evals(workdirs[counts[0]]):
            return False, f"{_n(n)}: eval results differ from {_n(counts[0])}"
    return True, (f"{len(ref)} steps, state hashes, example indices and "
                  f"{len(_evals(workdirs[counts[0]]))} evals equal on "
                  f"{', '.join(map(str, counts))} devices")


def _n(count: int) -> str:
    return f"{count} device" + ("" if count == 1 else "s")


def run_from_cli(argv: list, workdir: str, counts: list[int], *,
                 negative_control: bool = False) -> int:
    """The driver: reruns the command line without the verify flags, once per count."""
    args = resume.without_flags(argv[1:], DROP, valued=("--workdir", "--verify_topologies"))
    mode = "false" if negative_control else "true"
    root = os.path.abspath(workdir)
    os.makedirs(root, exist_ok=True)
    workdirs = {}
    for n in counts:
        run_dir = os.path.join(root, f"devices_{n}")
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
        ).strip()}
        command = [sys.executable, "-m", "jtrain.main", *args, f"--workdir={run_dir}",
                   "--config.debug.hash_every_steps=1",
                   f"--config.determinism.topology_invariant={mode}"]
        code = resume._run(command, env, run_dir + ".log", timeout=TIMEOUT_S)[0]  # 124: timeout
        if code != 0:
            _say(f"FAIL: the run on {n} devices exited {code} (see {run_dir}.log)",
                 negative_control)
            return 1
        workdirs[n] = run_dir
    ok, text = compare(workdirs)
    _say(("PASS: " if ok else "FAIL: ") + text, negative_control)
    return 0 if ok else 1


def _say(line: str, negative_control: bool) -> None:
    sys.stdout.write(f"jtrain: verify_topologies: {line}"
                     + (" (negative control: determinism.topology_invariant off)"
                        if negative_control else "") + "\n")
    sys.stdout.flush()
