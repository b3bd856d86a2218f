"""Ray: N jtrain processes as one job on a Ray cluster, the whole group restarted after a
lost worker, every restart resuming from the workdir.

    python launch/ray_job.py --num_workers=2 -- --config=configs/base.py --workdir=/shared/run
    python launch/ray_job.py --num_workers=4 --gpus_per_worker=8 --address=auto -- ARGS
    ray job submit -- python launch/ray_job.py --num_workers=2 -- ARGS

- One Ray actor per jtrain process, all placed at once in a placement group (one bundle
  of `--cpus_per_worker` CPUs and `--gpus_per_worker` GPUs each; `--placement=SPREAD` by
  default, STRICT_SPREAD for one process per node). Each actor runs
  `python -m jtrain.main ARGS` as its child, in the driver's directory, with
  JTRAIN_COORDINATOR (the rank-0 actor's node address and a port free there),
  JTRAIN_NUM_PROCESSES, JTRAIN_PROCESS_ID (the actor's rank) and a JTRAIN_ROLLCALL_TOKEN
  drawn for each attempt: jtrain.main starts `jax.distributed` from them as under
  launch/local.sh. The child dies with its actor (the parent-death signal), so a lost
  actor leaves no jtrain process behind.
- A process that ends with a signal (a lost worker, SIGKILL, an OOM kill), with exit 5
  (a peer lost, a hang) or 1, or an actor or node Ray loses, fails the attempt: the
  other processes get SIGTERM, then SIGKILL after `--grace_s`, the group is released
  and started again with the same arguments, up to `--max_restarts` times; jtrain
  resumes from the newest checkpoint in the workdir, bitwise. Exit 2, 3, 4 and 6 (a bad
  config, a checkpoint that cannot be restored, a halt, a full disk) would fail again:
  the driver exits with that code at once. Why the driver restarts the group instead of
  Ray restarting an actor: `jax.distributed` cannot take one new process into a running
  job; every process must start again together.
- The workdir (and the config, and a user's model modules) must be at the same path on
  every node: a shared filesystem. Process i's output goes to WORKDIR/logs/proc_<i>.log
  (each attempt appended under a header line); the driver prints its own lines
  (`ray_job: ...`) and, at the end, the last lines of process 0's output.
- SIGTERM / SIGINT to the driver goes to every jtrain process (each saves its step and
  exits 0); the driver then exits 0 without restarting.
- `--address`: Ray's own (unset: RAY_ADDRESS, else a running cluster on this machine,
  else a new local one; `local`: always a new local one, with `--num_workers` x
  `--cpus_per_worker` CPUs). `--cpu_devices=K` gives each process K fake CPU devices
  (JAX_PLATFORMS=cpu), as launch/local.sh's DEVICES=K. The driver's JAX_*, XLA_* and
  JTRAIN_* variables are passed to every process. No secret goes on a worker's command
  line: ARGS holding one (a password in `--tune.storage`) are refused (exit 2); the
  database password travels as JTRAIN_TUNE_DB_PASSWORD in the environment.

Exit status: 0 when every process finished (or a signal stopped them, saved), else the
failing process's code (128 + the signal for a signal death) once no restart is left,
2 for a bad command line here or no placement within `--placement_timeout_s`.
Tested by tests/multihost/test_ray_job.py on a local cluster of two processes.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from typing import Any

# Exit codes of jtrain that the same command would meet again (jtrain/errors.py).
FINAL = {2: "a bad config, data or command line", 3: "a checkpoint that cannot be restored",
         4: "a halt (non-finite loss, loss spikes)", 6: "a full disk"}
PASSED_ON = ("JAX_", "XLA_", "JTRAIN_")
SET_HERE = ("JTRAIN_COORDINATOR", "JTRAIN_NUM_PROCESSES", "JTRAIN_PROCESS_ID",
            "JTRAIN_ROLLCALL_TOKEN")
TAIL_LINES = 20


def say(line: str) -> None:
    print(f"ray_job: {line}", file=sys.stderr, flush=True)


def parse(argv):
    p = argparse.ArgumentParser(prog="python launch/ray_job.py",
                                description="N jtrain processes as one job on a Ray cluster",
                                usage="%(prog)s --num_workers=N [options] -- JTRAIN ARGS")
    p.add_argument("--num_workers", type=int, required=True, help="jtrain processes")
    p.add_argument("--address", default=None, help="Ray cluster address (ray.init's; "
                   "'local' starts a new local cluster)")
    p.add_argument("--cpus_per_worker", type=float, default=1)
    p.add_argument("--gpus_per_worker", type=float, default=0)
    p.add_argument("--cpu_devices", type=int, default=0,
                   help="fake CPU devices per process (0: the real devices)")
    p.add_argument("--placement", default="SPREAD",
                   choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"])
    p.add_argument("--placement_timeout_s", type=float, default=600)
    p.add_argument("--max_restarts", type=int, default=3,
                   help="restarts of the whole group after a lost or failed process")
    p.add_argument("--grace_s", type=float, default=30,
                   help="seconds between SIGTERM and SIGKILL for the other processes")
    if "--" not in argv:
        p.error("the jtrain arguments follow '--' (-- --config=... --workdir=DIR)")
    split = argv.index("--")
    args = p.parse_args(argv[:split])
    args.jtrain = argv[split + 1:]
    if args.num_workers < 1:
        p.error(f"--num_workers must be a positive integer, got {args.num_workers}")
    if args.max_restarts < 0 or args.grace_s < 0 or args.cpu_devices < 0:
        p.error("--max_restarts, --grace_s and --cpu_devices must not be negative")
    workdirs = [a.split("=", 1)[1] for a in args.jtrain if a.startswith("--workdir=")]
    if not workdirs or not workdirs[-1]:
        p.error("--workdir=DIR is required among the jtrain arguments")
    args.workdir = workdirs[-1]
    return args


class Worker:
    """One jtrain process (a Ray actor: Worker.options(...).remote(rank))."""

    def __init__(self, rank: int):
        self.rank = rank
        self.proc: subprocess.Popen | None = None
        self.log = ""

    def coordinator(self) -> str:
        """host:port of this node's address and a port free on it now."""
        import ray

        host = ray.util.get_node_ip_address()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        return f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"

    def start(self, argv, cwd: str, env: dict, log: str, attempt: int) -> int:
        os.makedirs(os.path.dirname(log), exist_ok=True)
        self.log = log
        with open(log, "a") as f:
            f.write(f"ray_job: attempt {attempt}, process {self.rank}\n")
            f.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jtrain.main", *argv], cwd=cwd,
                env={**os.environ, **env}, stdin=subprocess.DEVNULL, stdout=f,
                stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        return self.proc.pid

    def wait(self) -> tuple[int, list[str]]:
        """(the exit status as a shell reports it, the last lines of the output)."""
        assert self.proc is not None
        rc = self.proc.wait()
        rc = 128 - rc if rc < 0 else rc
        with open(self.log, errors="replace") as f:
            lines = f.read().splitlines()
        start = max(i for i, ln in enumerate(lines) if ln.startswith("ray_job: attempt "))
        return rc, lines[start + 1:][-TAIL_LINES:]

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)
            if signum != signal.SIGKILL:
                self.proc.send_signal(signal.SIGCONT)


def _die_with_parent() -> None:
    """In the child: SIGKILL when the actor's process dies (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


class Job:
    def __init__(self, args):
        self.args = args
        self.stopping: str | None = None
        self.actors: list = []

    def forward(self, signum, _frame) -> None:
        self.stopping = signal.Signals(signum).name
        say(f"{self.stopping} received: passing it to every process (each saves its step)")
        for a in self.actors:
            a.signal.remote(signum)

    def env(self, rank: int, coordinator: str, token: str) -> dict:
        env = {k: v for k, v in os.environ.items()
               if k.startswith(PASSED_ON) and k not in SET_HERE}
        if self.args.cpu_devices:
            env["JAX_PLATFORMS"] = "cpu"
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                                f"device_count={self.args.cpu_devices}").strip()
        return {**env, "JTRAIN_COORDINATOR": coordinator,
                "JTRAIN_NUM_PROCESSES": str(self.args.num_workers),
                "JTRAIN_PROCESS_ID": str(rank), "JTRAIN_ROLLCALL_TOKEN": token}

    def attempt(self, number: int) -> tuple[int, int | None, list[str]]:
        """One run of the whole group: (exit status, the failing rank or None, its lines)."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        a = self.args
        bundle = {"CPU": a.cpus_per_worker, **({"GPU": a.gpus_per_worker}
                                               if a.gpus_per_worker else {})}
        group = placement_group([dict(bundle) for _ in range(a.num_workers)],
                                strategy=a.placement)
        try:
            ready, _ = ray.wait([group.ready()], timeout=a.placement_timeout_s)
            if not ready:
                say(f"no placement for {a.num_workers} workers of {bundle} within "
                    f"{a.placement_timeout_s:g} s (--placement_timeout_s); the cluster has "
                    f"{ray.cluster_resources()}")
                return 2, None, []
            remote = ray.remote(Worker)
            self.actors = [remote.options(
                max_concurrency=4, num_cpus=a.cpus_per_worker, num_gpus=a.gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=i)).remote(i)
                for i in range(a.num_workers)]
            coordinator = ray.get(self.actors[0].coordinator.remote())
            token = secrets.token_hex(16)
            cwd = os.getcwd()
            ray.get([w.start.remote(a.jtrain, cwd, self.env(i, coordinator, token),
                                    os.path.join(cwd, a.workdir, "logs", f"proc_{i}.log"),
                                    number)
                     for i, w in enumerate(self.actors)])
            say(f"attempt {number}: {a.num_workers} processes, coordinator {coordinator}")
            return self.wait_all()
        finally:
            for w in self.actors:
                ray.kill(w)
            self.actors = []
            remove_placement_group(group)

    def wait_all(self) -> tuple[int, int | None, list[str]]:
        import ray

        pending = {w.wait.remote(): i for i, w in enumerate(self.actors)}
        tails: dict[int, list[str]] = {}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            rank = pending.pop(done[0])
            try:
                rc, tails[rank] = ray.get(done[0])
            except ray.exceptions.RayError as e:  # the actor or its node was lost
                rc, tails[rank] = 128 + signal.SIGKILL, [f"lost: {type(e).__name__}"]
            if rc != 0:
                say(f"process {rank} exited with status {rc}; stopping the others")
                self.stop_rest(list(pending))
                return rc, rank, tails[rank]
        return 0, None, tails.get(0, [])

    def stop_rest(self, refs) -> None:
        import ray

        for w in self.actors:
            w.signal.remote(signal.SIGTERM)
        _, late = ray.wait(refs, num_returns=len(refs), timeout=self.args.grace_s)
        if late:
            for w in self.actors:
                ray.get(w.signal.remote(signal.SIGKILL))
            ray.wait(late, num_returns=len(late), timeout=30)


def secret_in_argv(argv) -> str | None:
    """The first argument holding a secret (a URI's password, a secret-named flag), shown
    masked; None when none does. Every worker's command line is visible to every user
    of its node, so secrets travel in the environment instead."""
    from jtrain.redact import redact_text

    for arg in argv:
        plain = re.sub(r"://[^\s:@/\"`]*@", "://", arg)  # a user name alone is no secret
        if redact_text(plain) != plain:
            return redact_text(arg)
    return None


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    shown = secret_in_argv(args.jtrain)
    if shown is not None:
        say(f"{shown}: a secret on the command line would be on every worker's command "
            "line; give the database password in JTRAIN_TUNE_DB_PASSWORD (passed to every "
            "process's environment) and the URL without it")
        return 2
    try:
        import ray
    except ImportError:
        say("Ray is not installed: pip install -c constraints.txt -e '.[ray]'")
        return 2
    local: dict[str, Any] = {}
    if args.address == "local":  # a new cluster of this job's size
        local = {"num_cpus": max(1, math.ceil(args.num_workers * args.cpus_per_worker)),
                 "num_gpus": math.ceil(args.num_workers * args.gpus_per_worker),
                 "include_dashboard": False}
    ray.init(address=args.address, log_to_driver=False, **local)
    job = Job(args)
    signal.signal(signal.SIGTERM, job.forward)
    signal.signal(signal.SIGINT, job.forward)
    try:
        for number in range(1, args.max_restarts + 2):
            rc, rank, tail = job.attempt(number)
            if rank is None and rc != 0:  # no placement: said already
                return rc
            if rc == 0 or job.stopping:
                print("\n".join(tail), flush=True)
                return rc
            if tail:
                say(f"the end of process {rank}'s output:")
                for line in tail[-3:]:
                    print(f"  {line}", file=sys.stderr)
            if rc in FINAL:
                say(f"exit {rc} is {FINAL[rc]}: a restart would fail the same way")
                return rc
            if number <= args.max_restarts:
                say(f"restarting the group ({number} of {args.max_restarts} restarts); "
                    "jtrain resumes from the newest checkpoint")
                time.sleep(1)
        say(f"no restart left (--max_restarts={args.max_restarts})")
        return rc
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
