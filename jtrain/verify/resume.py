"""`--verify_resume`: proof of exact resume (docs/guide/determinism.md).

The config runs twice, as separate processes: DIR/reference uninterrupted and watched
(its checkpoint steps and the start of its final save form a timeline), and
DIR/interrupted, SIGKILLed `--verify_kills` times (mid-step, mid-eval, mid-save through
the fault points of `jtrain.control.faults`, and at random moments) and restarted with
the same command after each kill. One line compares the final `state_sha256` of both:
PASS (exit 0), FAIL or INCONCLUSIVE (exit 1). A PASS means every kill landed before the
final save (each placed from the restored step and the reference timeline; one that
cannot be placed or did not land is a FAIL), a restart resumed from a checkpoint
strictly between step 0 and the final step (else INCONCLUSIVE), and the final step and
hash equal the reference's. `--verify_negative_control` turns off restoring the data
position (JTRAIN_SKIP_DATA_RESTORE): the verifier must then FAIL.

A bucket workdir (`s3://bucket/run`): the runs are its prefixes reference/ and
interrupted/, each process with a local staging copy the verifier names
(JTRAIN_STAGING_DIR) and watches; logs are uploaded beside the runs. Both runs share a
compilation cache (WORKDIR/jax_cache unless JAX_COMPILATION_CACHE_DIR is set).

`verify_resume(command, root, ...)` is the library form (`command(workdir)`: the argv
of one run whose script calls `jtrain.train`); `place_kill` and `judge` are its pure
parts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from jtrain.checkpoint import integrity, store
from jtrain.control import faults
from jtrain.errors import WorkdirError
from jtrain.observe import runfiles

TIMEOUT_S = 3600
POLL_S = 0.01  # how often a running process's checkpoint directory is looked at


@dataclasses.dataclass
class Verdict:
    ok: bool
    line: str
    reference_sha: str | None = None
    interrupted_sha: str | None = None
    resumed_from: list = dataclasses.field(default_factory=list)
    kills: list = dataclasses.field(default_factory=list)
    landed: int = 0
    requested: int = 0


@dataclasses.dataclass
class Timeline:
    """What the reference run shows: its final step, the steps it saved at (all those
    seen while it ran, or only those kept when it was not watched) and the seconds from
    its start to the start of its final save (None when unknown)."""
    final_step: int
    save_steps: list[int]
    last_save_s: float | None = None


@dataclasses.dataclass
class Placed:
    """One kill as made on one restart: JTRAIN_FAULT (or None), a wall-clock SIGKILL
    after `after_s` seconds, a SIGKILL once a checkpoint at step >= `when_saving` appears."""
    label: str
    fault: str | None = None
    after_s: float | None = None
    when_saving: int | None = None


@dataclasses.dataclass
class Attempt:
    """One process of the interrupted run: the kill asked of it (None for the last,
    unkilled one), the newest finished checkpoint step when it started, its exit code
    (-9: SIGKILL) and the kill's label as it landed."""
    kill: str | None
    restored: int | None
    code: int
    label: str | None = None
    made: bool = True  # False: the kill could not be placed, the process was not started

    @property
    def landed(self) -> bool:
        return self.kill is not None and self.code == -signal.SIGKILL


def _summary(workdir: str) -> dict | None:
    try:
        return runfiles.read_object(os.path.join(workdir, "summary.json"))
    except (FileNotFoundError, WorkdirError):
        return None


def _finished_steps(workdir: str) -> list[int]:
    directory = os.path.join(workdir, "checkpoints")
    steps, _, _ = integrity.scan(directory)
    return [s for s in steps
            if os.path.isfile(os.path.join(directory, str(s), integrity.MANIFEST))]


_STEP_NAME = re.compile(r"^(\d+)(?:$|" + re.escape(integrity.TMP_MARK) + ")")


def _entries(workdir: str) -> dict[str, int]:
    """{name: step} of the checkpoint directories present now, finished or still being
    written."""
    try:
        names = os.listdir(os.path.join(workdir, "checkpoints"))
    except OSError:
        return {}
    return {m.group(0): int(m.group(1)) for m in map(_STEP_NAME.match, names) if m}


def _new_save_watch(workdir: str, bound: int) -> Callable[[float], bool]:
    """True once a checkpoint entry of step >= `bound` appears that was not there at
    the start (a killed save's leftover does not count until it is written again)."""
    before = set(_entries(workdir))
    return lambda _elapsed: any(step >= bound and name not in before
                                for name, step in _entries(workdir).items())


def _run(argv, env, log_path, *, kill_after: float | None = None,
         watch: Callable[[float], bool] | None = None,
         timeout: float = TIMEOUT_S) -> tuple[int, float, str | None]:
    """Run once, polling: SIGKILL after `kill_after` seconds or when `watch(elapsed)`
    says so (returncode -9), or after `timeout` (returncode 124). Returns
    (returncode, seconds, "timer" / "watch" / None: who killed it)."""
    t0 = time.monotonic()
    by = None
    with open(log_path, "ab") as log:
        # Its own process group: a kill takes its data-loader workers along, like a
        # machine that goes away.
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        while proc.poll() is None:
            elapsed = time.monotonic() - t0
            if elapsed > timeout:
                by = "timeout"
            elif kill_after is not None and elapsed >= kill_after:
                by = "timer"
            elif watch is not None and watch(elapsed):
                by = "watch"
            if by:
                _kill_group(proc.pid)
                proc.wait()
                break
            time.sleep(POLL_S)
        _kill_group(proc.pid)  # leftovers of a process that killed itself
    code = 124 if by == "timeout" else proc.returncode
    return code, time.monotonic() - t0, (None if by == "timeout" else by)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_plan(kills: int, rng: random.Random, *, steps_hint: int, ref_seconds: float):
    """One entry per kill: ("step", n) / ("eval", 1) / ("save", n) fault points and
    ("time", seconds) external kills, shuffled. `ref_seconds`: the reference's seconds
    to its final save (time kills land before it; `place_kill` bounds every kill
    again on each restart)."""
    plan = [("step", rng.randint(max(2, steps_hint * 3 // 10), max(3, steps_hint * 7 // 10))),
            ("eval", 2), ("save", 2)]  # the 2nd of a restart: after some progress
    while len(plan) < kills:
        plan.append(("time", round(rng.uniform(0.3, 0.9) * ref_seconds, 2)))
    plan = plan[:kills]
    rng.shuffle(plan)
    return plan


def place_kill(kind: str, value, restored: int | None, timeline: Timeline,
               later: int = 0) -> Placed | None:
    """The kill `(kind, value)` of the plan, made on a restart that resumes from
    `restored`, so that it lands strictly before the final save; `later` kills must
    still fit after it. None when no kill can land before the final save."""
    start, final = restored or 0, timeline.final_step
    room = final - start - 1  # steps of this restart before the final one
    if room < 1:
        return None
    # A step kill fires after its step's eval, before its save: step `start + k`, k <= room,
    # is before the final step. One asked for too late gets an equal share of the room
    # left, so the kills after it still have saves to resume from.
    step_k = max(1, room // (later + 1))
    saves = [s for s in timeline.save_steps if start < s < final]
    if kind == "step":
        k = int(value) if int(value) <= room - later else step_k
        return Placed(f"step:{k}" + ("" if k == int(value) else f" [was step:{value}]"),
                      fault=f"step:{k}")
    if kind == "time":
        return Placed(f"time:{value}", fault=f"step:{step_k}", after_s=float(value))
    if kind in ("save", "eval") and not saves:  # no save left before the final one
        k = max(1, step_k // 2)
        return Placed(f"step:{k} [was {kind}:{value}]", fault=f"step:{k}")
    if kind == "save":  # the k-th save of this restart is one of `saves`
        k = min(int(value), max(1, len(saves) - later))
        return Placed(f"save:{k}" + ("" if k == int(value) else f" [was save:{value}]"),
                      fault=f"save:{k}")
    if kind == "eval":  # eval steps are not known: kill by the last save before the final
        return Placed(f"eval:{value}", fault=f"eval:{value}", when_saving=saves[-1])
    raise ValueError(f"unknown kill kind {kind!r} (step, eval, save, time)")


def judge(reference: dict, final: dict | None, attempts: list[Attempt],
          requested: int, log_path: str = "the log") -> Verdict:
    """The verdict from the reference summary, the interrupted run's final summary and
    its processes in order. PASS only when the run finished, every requested kill
    landed, some restart resumed from 0 < step < final step, and the states match."""
    kills = [(a.label or a.kill) if a.landed else
             f"{a.label or a.kill} ({f'exit {a.code}, ' if a.made else ''}not killed)"
             for a in attempts if a.kill is not None]
    landed = sum(a.landed for a in attempts)
    total = reference.get("step")
    resumed = [a.restored for a in attempts[1:] if a.made and a.restored is not None
               and total is not None and 0 < a.restored < total]
    a_sha, b_sha = reference.get("state_sha256"), (final or {}).get("state_sha256")
    common = {"reference_sha": a_sha, "interrupted_sha": b_sha, "resumed_from": resumed,
              "kills": kills, "landed": landed, "requested": requested}
    bad = [a for a in attempts if a.code not in (0, -signal.SIGKILL)]
    if bad:
        return Verdict(False, f"FAIL: a restarted run exited {bad[0].code} "
                              f"(see {log_path})", **common)
    if final is None or not attempts or attempts[-1].code != 0:
        return Verdict(False, f"FAIL: the interrupted run did not finish (see {log_path})",
                       **common)
    detail = (f"{landed}/{requested} kills landed ({', '.join(kills) or 'none'}), "
              f"restarts resumed from steps {resumed or 'none'} of {total}; final step "
              f"{final.get('step')} vs {total}, state_sha256 {str(b_sha)[:12]} vs "
              f"{str(a_sha)[:12]}")
    if landed < requested:
        return Verdict(False, f"FAIL: only {detail}", **common)
    if not resumed:
        return Verdict(False, f"INCONCLUSIVE: no restart resumed from a checkpoint "
                              f"between step 0 and the final step; {detail}", **common)
    if a_sha == b_sha and final.get("step") == total:
        return Verdict(True, f"PASS: bitwise identical after {detail}", **common)
    return Verdict(False, f"FAIL: resumed run differs from the uninterrupted one: {detail}",
                   **common)


class _LocalRun:
    """A run directory on this machine: given to the command and watched as it is."""

    def __init__(self, path: str):
        self.path = self.watched = path

    def fresh(self) -> None:
        _fresh(self.path)

    def next_process(self) -> dict:
        """The environment of the next process of this run (and `watched` set for it)."""
        return {}

    def summary(self) -> dict | None:
        return _summary(self.path)

    def finished_steps(self) -> list[int]:
        return _finished_steps(self.path)


class _BucketRun(_LocalRun):
    """A run directory in a bucket: each process gets a fresh staging copy under
    `scratch`, the one watched; steps and summary.json are read from the bucket."""

    def __init__(self, uri: str, scratch: str):
        self.path, self._scratch, self._processes = uri, scratch, 0
        self.watched = os.path.join(scratch, "none")

    def _fs(self):
        return store.filesystem(self.path), store.split(self.path)[1]

    def fresh(self) -> None:
        fs, root = self._fs()
        try:
            if fs.exists(root):
                fs.rm(root, recursive=True)
        except Exception as e:
            raise store.failure(self.path, e, "emptying the prefix") from None

    def next_process(self) -> dict:
        self._processes += 1
        self.watched = os.path.join(self._scratch, "staging", f"{os.path.basename(self.path)}"
                                    f"-{self._processes}")
        return {store.STAGING_ENV: self.watched}

    def summary(self) -> dict | None:
        fs, root = self._fs()
        try:
            return json.loads(fs.cat(f"{root}/summary.json"))
        except (FileNotFoundError, ValueError):
            return None
        except Exception as e:
            raise store.failure(self.path, e, "reading summary.json") from None

    def finished_steps(self) -> list[int]:
        mirror = store.Mirror(self.path, owner=False)
        try:
            return mirror.committed_steps()[0]
        finally:
            mirror.close()


def _reference_run(command, ref_dir, env, log_path, timeout):
    """Run the reference (a path, a _LocalRun or a _BucketRun), watching its checkpoint
    directory: (code, seconds, seen) with `seen` = {step: seconds from start when its
    checkpoint first appeared}."""
    seen: dict[int, float] = {}
    if isinstance(ref_dir, str):
        ref_dir = _LocalRun(ref_dir)
    env = {**env, **ref_dir.next_process()}

    def watch(elapsed: float) -> bool:
        for step in _entries(ref_dir.watched).values():
            seen.setdefault(step, elapsed)
        return False

    code, seconds, _ = _run(command(ref_dir.path), env, log_path, watch=watch,
                            timeout=timeout)
    watch(seconds)  # a save that finished after the last poll: at most `seconds`
    return code, seconds, seen


def verify_resume(command: Callable[[str], list], root: str, *, kills: int = 4,
                  seed: int | None = None, env: dict | None = None,
                  negative_control: bool = False, reference: str | None = None,
                  plan: list | None = None, timeout: float = TIMEOUT_S,
                  local_dir: str = "", bucket: str = "") -> Verdict:
    """Reference run (unless `reference` names a finished one), then the killed run.
    `plan`: the kills to make, as `kill_plan` returns them (default: random); each is
    placed before the final save on its restart (`place_kill`). `local_dir`: the run's
    checkpoint.local_dir (a restart resumes from the newer tier's step). `bucket`: a
    URI; the runs are its prefixes reference/ and interrupted/, `root` holds the logs,
    the staging copies and the compilation cache."""
    rng = random.Random(seed if seed is not None else time.time_ns())
    env = dict(os.environ if env is None else env)
    if "JAX_COMPILATION_CACHE_DIR" not in env:  # restarts reuse compiled programs
        env.update(JAX_COMPILATION_CACHE_DIR=os.path.join(root, "jax_cache"),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    env.pop(faults.FAULT_ENV, None)
    env.pop(faults.SKIP_DATA_RESTORE_ENV, None)
    env.pop(store.STAGING_ENV, None)
    os.makedirs(root, exist_ok=True)
    ref_dir: _LocalRun = _LocalRun(reference or os.path.join(root, "reference"))
    run_dir: _LocalRun = _LocalRun(os.path.join(root, "interrupted"))
    if bucket:
        ref_dir, run_dir = (_BucketRun(f"{bucket}/{name}", root)
                            for name in ("reference", "interrupted"))
    seen: dict[int, float] = {}
    if reference is None:
        ref_dir.fresh()
        code, _, seen = _reference_run(command, ref_dir, env,
                                       os.path.join(root, "reference.log"), timeout)
        if code != 0:
            return Verdict(False, f"FAIL: the reference run exited {code} "
                                  f"(see {os.path.join(root, 'reference.log')})")
    ref = ref_dir.summary()
    if ref is None or not isinstance(ref.get("step"), int):
        return Verdict(False, f"FAIL: no summary.json with a step in {ref_dir.path}")
    final_step = ref["step"]
    timeline = Timeline(final_step, sorted(set(seen) | set(ref_dir.finished_steps())),
                        seen.get(final_step))

    run_dir.fresh()
    if plan is None:
        plan = kill_plan(kills, rng, steps_hint=final_step,
                         ref_seconds=timeline.last_save_s or 30.0)
    plan = list(plan)
    attempts: list[Attempt] = []
    log_path = os.path.join(root, "interrupted.log")
    for i, entry in enumerate(plan + [None]):
        restored = (run_dir.finished_steps() or [None])[-1]
        if local_dir:
            from jtrain.checkpoint import tiers

            local = (tiers.local_steps(run_dir.path, local_dir) or [None])[-1]
            restored = local if tiers.newer_tier(local, restored) == "local" else restored
        placed = None
        if entry is not None:
            placed = place_kill(*entry, restored, timeline, later=len(plan) - i - 1)
            if placed is None:  # cannot land before the final save: counted, not made
                attempts.append(Attempt(f"{entry[0]}:{entry[1]}", restored, 0,
                                        f"{entry[0]}:{entry[1]} [no room before the "
                                        f"final save]", made=False))
                continue
        run_env = {**env, **run_dir.next_process()}
        if negative_control and i > 0:
            run_env[faults.SKIP_DATA_RESTORE_ENV] = "1"
        if placed is not None and placed.fault:
            run_env[faults.FAULT_ENV] = placed.fault
        watch = None
        if placed is not None and placed.when_saving is not None:
            watch = _new_save_watch(run_dir.watched, placed.when_saving)
        code, _, by = _run(command(run_dir.path), run_env, log_path, timeout=timeout,
                           kill_after=placed.after_s if placed else None, watch=watch)
        label = placed.label if placed else None
        if placed is not None and code == -signal.SIGKILL:
            if placed.after_s is not None and by is None:
                label = f"{placed.fault} [backstop of {placed.label}]"
            elif by == "watch":
                label = f"{placed.label} [at save {placed.when_saving}]"
        attempts.append(Attempt(f"{entry[0]}:{entry[1]}" if entry else None,
                                restored, code, label))
        if code != -signal.SIGKILL:
            break  # finished (a kill that did not land), or failed
    return judge(ref, run_dir.summary(), attempts, len(plan), log_path)


def _fresh(path: str) -> None:
    if os.path.islink(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)
    os.makedirs(path)


def without_flags(argv: list, drop: tuple, valued: tuple) -> list:
    """argv less the flags named in `drop` (those in `valued` take the next argument as
    their value when written without `=`): a verifier's own flags, before it reruns the
    command."""
    args, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in drop:
            skip = "=" not in a and name in valued
            continue
        args.append(a)
    return args


def run_from_cli(argv: list, workdir: str, *, kills: int,
                 negative_control: bool = False, local_dir: str = "") -> int:
    """The --verify_resume driver: reruns the same command line without the verify
    flags, with --workdir pointing into WORKDIR."""
    args = without_flags(argv[1:], ("--workdir", "--verify_resume", "--verify_kills",
                                    "--verify_negative_control", "--noverify_resume",
                                    "--noverify_negative_control"),
                         valued=("--workdir", "--verify_kills"))
    if any(a.startswith(("--num_processes", "--distributed=auto")) for a in args):
        sys.stderr.write("jtrain: verify_resume: single-process runs only\n")
        return 2

    def command(run_dir):
        return [sys.executable, "-m", "jtrain.main", *args, f"--workdir={run_dir}"]

    if store.is_remote(workdir):
        verdict = _in_bucket(command, workdir.rstrip("/"), kills=kills,
                             negative_control=negative_control)
    else:
        verdict = verify_resume(command, os.path.abspath(workdir), kills=kills,
                                negative_control=negative_control, local_dir=local_dir)
    sys.stdout.write(f"jtrain: verify_resume: {verdict.line}"
                     + (" (negative control: data position not restored)"
                        if negative_control else "") + "\n")
    sys.stdout.flush()
    return 0 if verdict.ok else 1


def _in_bucket(command, uri: str, **kwargs) -> Verdict:
    """verify_resume into the bucket prefix `uri`, its scratch in a temporary directory;
    the logs uploaded beside the runs and named by their URIs in the verdict."""
    import tempfile

    store.check(uri)
    scratch = tempfile.mkdtemp(prefix="jtrain-verify-")
    try:
        verdict = verify_resume(command, scratch, bucket=uri, **kwargs)
        logs = [n for n in ("reference.log", "interrupted.log")
                if os.path.isfile(os.path.join(scratch, n))]
        if logs:
            fs, root = store.filesystem(uri), store.split(uri)[1]
            try:
                fs.put([os.path.join(scratch, n) for n in logs], [f"{root}/{n}" for n in logs])
            except Exception as e:
                raise store.failure(uri, e, "uploading the logs") from None
        verdict.line = verdict.line.replace(scratch, uri)
        return verdict
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
