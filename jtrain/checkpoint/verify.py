"""`python -m jtrain.main --config=... --workdir=DIR --verify_resume`: proof of exact resume.

Runs the config twice, as separate processes with the same environment:
  reference    DIR/reference, uninterrupted;
  interrupted  DIR/interrupted, killed with SIGKILL `--verify_kills` times and restarted
               with the same command after each kill. The kills land mid-step, mid-eval,
               mid-save (fault points, see `jtrain.control`) and at random wall-clock
               moments, in a random order.
Then compares the final `state_sha256` of both summaries and prints one line:
  jtrain: verify_resume: PASS: ...   (exit 0)
  jtrain: verify_resume: FAIL: ...   (exit 1: a mismatch, or a run that failed)
A verdict needs at least one restart that resumed from a checkpoint after step 0;
otherwise it is INCONCLUSIVE (exit 1).

`--verify_negative_control` disables restoring the data position on restarts
(JTRAIN_SKIP_DATA_RESTORE): the verifier must then FAIL, which shows it can see a
resume that is not exact.

Both runs share a JAX compilation cache (WORKDIR/jax_cache unless
JAX_COMPILATION_CACHE_DIR is set): restarts load the reference's executables instead of
compiling again, which keeps the check quick and changes no result.

`verify_resume(command, root, ...)` is the library form: `command(workdir)` gives the
argv of one training run (any script that trains into `workdir` and writes
`summary.json`), e.g. a `jtrain.train` call with a torch dataset.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from typing import Callable

from jtrain.checkpoint import integrity
from jtrain.control import faults

TIMEOUT_S = 3600


@dataclasses.dataclass
class Verdict:
    ok: bool
    line: str
    reference_sha: str | None = None
    interrupted_sha: str | None = None
    resumed_from: list = dataclasses.field(default_factory=list)
    kills: list = dataclasses.field(default_factory=list)


def _summary(workdir: str) -> dict | None:
    try:
        with open(os.path.join(workdir, "summary.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _finished_steps(workdir: str) -> list[int]:
    directory = os.path.join(workdir, "checkpoints")
    steps, _, _ = integrity.scan(directory)
    return [s for s in steps
            if os.path.isfile(os.path.join(directory, str(s), integrity.MANIFEST))]


def _run(argv, env, log_path, *, kill_after: float | None = None,
         timeout: float = TIMEOUT_S) -> tuple[int, float]:
    """Run once; SIGKILL after `kill_after` seconds if given (returncode -9), or after
    `timeout` (returncode 124). Returns (returncode, seconds)."""
    t0 = time.monotonic()
    code = None
    with open(log_path, "ab") as log:
        # Its own process group: a kill takes its data-loader workers along, like a
        # machine that goes away.
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=min(kill_after, timeout) if kill_after is not None else timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            proc.wait()
            if kill_after is None or kill_after > timeout:
                code = 124
        _kill_group(proc.pid)  # leftovers of a process that killed itself
    return (proc.returncode if code is None else code), time.monotonic() - t0


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_plan(kills: int, rng: random.Random, *, steps_hint: int, ref_seconds: float):
    """One entry per kill: ("step", n) / ("eval", 1) / ("save", n) fault points and
    ("time", seconds) external kills, shuffled."""
    plan = [("step", rng.randint(max(2, steps_hint * 3 // 10), max(3, steps_hint * 7 // 10))),
            ("eval", 2), ("save", 2)]  # the 2nd of a restart: after some progress
    while len(plan) < kills:
        plan.append(("time", round(rng.uniform(0.3, 0.9) * ref_seconds, 2)))
    plan = plan[:kills]
    rng.shuffle(plan)
    return plan


def verify_resume(command: Callable[[str], list], root: str, *, kills: int = 4,
                  seed: int | None = None, env: dict | None = None,
                  negative_control: bool = False, reference: str | None = None,
                  plan: list | None = None, timeout: float = TIMEOUT_S) -> Verdict:
    """Reference run (unless `reference` names a finished one), then the killed run.
    `plan`: the kills to make, as `kill_plan` returns them (default: random)."""
    rng = random.Random(seed if seed is not None else time.time_ns())
    env = dict(os.environ if env is None else env)
    if "JAX_COMPILATION_CACHE_DIR" not in env:  # restarts reuse compiled programs
        env.update(JAX_COMPILATION_CACHE_DIR=os.path.join(root, "jax_cache"),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    env.pop(faults.FAULT_ENV, None)
    env.pop(faults.SKIP_DATA_RESTORE_ENV, None)
    os.makedirs(root, exist_ok=True)
    ref_dir = reference or os.path.join(root, "reference")
    run_dir = os.path.join(root, "interrupted")
    ref_seconds = 30.0
    if reference is None:
        _fresh(ref_dir)
        code, ref_seconds = _run(command(ref_dir), env, os.path.join(root, "reference.log"),
                                 timeout=timeout)
        if code != 0:
            return Verdict(False, f"FAIL: the reference run exited {code} "
                                  f"(see {os.path.join(root, 'reference.log')})")
    ref = _summary(ref_dir)
    if ref is None:
        return Verdict(False, f"FAIL: no summary.json in {ref_dir}")

    _fresh(run_dir)
    if plan is None:
        plan = kill_plan(kills, rng, steps_hint=int(ref.get("step") or 100),
                         ref_seconds=ref_seconds)
    done, history = [], []
    log_path = os.path.join(root, "interrupted.log")
    for i, (kind, value) in enumerate(plan + [("none", None)]):
        run_env = dict(env)
        if negative_control and i > 0:
            run_env[faults.SKIP_DATA_RESTORE_ENV] = "1"
        if kind in ("step", "eval", "save"):
            run_env[faults.FAULT_ENV] = f"{kind}:{value}"
        before = _finished_steps(run_dir)
        code, _ = _run(command(run_dir), run_env, log_path, timeout=timeout,
                       kill_after=value if kind == "time" else None)
        if kind != "none":
            history.append(f"{kind}:{value}" + ("" if code == -signal.SIGKILL else
                                                f"(exit {code}, not killed)"))
        done.append(before[-1] if before else None)
        if code == 0:
            break
        if code != -signal.SIGKILL:
            return Verdict(False, f"FAIL: a restarted run exited {code} (see {log_path})",
                           kills=history)
    final = _summary(run_dir)
    if final is None or code != 0:
        return Verdict(False, f"FAIL: the interrupted run did not finish (see {log_path})",
                       kills=history)
    resumed = [s for s in done[1:] if s]
    a, b = ref.get("state_sha256"), final.get("state_sha256")
    killed = sum(1 for h in history if "not killed" not in h)
    detail = (f"{killed} kills ({', '.join(history)}), restarts resumed from steps "
              f"{resumed or 'none'}; final step {final.get('step')} vs {ref.get('step')}, "
              f"state_sha256 {str(b)[:12]} vs {str(a)[:12]}")
    if not resumed:
        return Verdict(False, f"INCONCLUSIVE: no restart resumed from a checkpoint; {detail}",
                       a, b, resumed, history)
    if a == b and final.get("step") == ref.get("step"):
        return Verdict(True, f"PASS: bitwise identical after {detail}", a, b, resumed, history)
    return Verdict(False, f"FAIL: resumed run differs from the uninterrupted one: {detail}",
                   a, b, resumed, history)


def _fresh(path: str) -> None:
    if os.path.islink(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)
    os.makedirs(path)


def run_from_cli(argv: list, workdir: str, *, kills: int,
                 negative_control: bool = False) -> int:
    """The --verify_resume driver: reruns the same command line without the verify
    flags, with --workdir pointing into WORKDIR."""
    drop = ("--workdir", "--verify_resume", "--verify_kills", "--verify_negative_control",
            "--noverify_resume", "--noverify_negative_control")
    args, skip = [], False
    for a in argv[1:]:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in drop:
            skip = "=" not in a and name in ("--workdir", "--verify_kills")
            continue
        args.append(a)
    if any(a.startswith(("--num_processes", "--distributed=auto")) for a in args):
        sys.stderr.write("jtrain: verify_resume: single-process runs only\n")
        return 2

    def command(run_dir):
        return [sys.executable, "-m", "jtrain.main", *args, f"--workdir={run_dir}"]

    verdict = verify_resume(command, os.path.abspath(workdir), kills=kills,
                            negative_control=negative_control)
    sys.stdout.write(f"jtrain: verify_resume: {verdict.line}"
                     + (" (negative control: data position not restored)"
                        if negative_control else "") + "\n")
    sys.stdout.flush()
    return 0 if verdict.ok else 1

