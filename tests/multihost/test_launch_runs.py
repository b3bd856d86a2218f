"""Real 2-process x 2-device training through each launcher, as users and schedulers run
them (subprocesses from a temp cwd, relative paths): one run on token shards, interrupted
four ways by four launchers (the first a SIGKILL in the middle of a shard), ends bitwise
equal to the uninterrupted one; a SIGSTOPped peer ends its
survivor with one line (exit 5); tpu_vm.sh delivers a SIGTERM to jtrain itself.

The same launches prove the persistent compilation cache across processes: the
uninterrupted run fills a fresh cache, and the first interrupted one (another 2-process
start of the same programs) compiles nothing in any process. On XLA:CPU each process's
cache key is its own, and JAX writes entries from process 0 only, so without jtrain's
writer the other process compiled every program at every start (and process 0 waited
for it in the first collective); jtrain.observe.compiles lets each process write its
own entries."""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest
import yaml

from launching import (LAUNCH, TINY, checkpoints, finish, free_port, start, summary,
                       token_shards, user_dir, wait_for_checkpoint_after)

pytestmark = pytest.mark.slow

STEPS = 40  # enough steps left after each interruption for the next signal to land
SYNTHETIC = [*TINY, f"--config.total_steps={STEPS}", "--config.checkpoint.every_steps=2",
             "--workdir=run"]
TOKENS = ["--config.data.name=tokens", "--config.data.path=shards"]
RUN = [*SYNTHETIC, *TOKENS]  # the journey's: token shards in the user's directory
TWO_DEVICES = "--xla_force_host_platform_device_count=2"
# The journey's runs share a cache in the user's directory, fresh at its first run; each
# compile, cache hit and miss is logged (into WORKDIR/train.log, every process's).
CACHE = "--config.compile.cache_dir=xla"
COMPILER_LOG = {"JAX_DEBUG_LOG_MODULES": "jax._src.compiler"}


def _local(cwd, *args, **env):
    return start(["bash", LAUNCH / "local.sh", 2, *args], cwd, DEVICES="2", **env)


def _compiles(workdir) -> tuple[int, int]:
    """(persistent-cache misses, hits) that the run's processes logged."""
    log = (workdir / "train.log").read_text()
    return log.count("PERSISTENT COMPILATION CACHE MISS"), log.count("cache hit for")


def _cache_entries(cwd) -> list[str]:
    return sorted(p.name for p in (cwd / "xla").iterdir())


@pytest.fixture(scope="module")
def journey(tmp_path_factory):
    """One run interrupted four ways, each launcher's result kept for the tests."""
    tmp_path = tmp_path_factory.mktemp("launch_runs")
    cwd = user_dir(tmp_path)
    assert token_shards(cwd) >= 3
    seen: dict = {}
    # The reference: uninterrupted, launch/local.sh, and saving no checkpoint (the saves
    # of the interrupted runs must not change the state either); a fresh cache.
    seen["reference"] = finish(_local(cwd, *TINY, *TOKENS, f"--config.total_steps={STEPS}",
                                      "--config.checkpoint.every_steps=0", "--workdir=ref",
                                      CACHE, **COMPILER_LOG))
    assert seen["reference"][0] == 0, seen["reference"][2] + seen["reference"][1]
    seen["reference_compiles"] = _compiles(cwd / "ref")
    seen["entries"] = _cache_entries(cwd)

    # 1. local.sh: both processes SIGKILLed at their 5th step -> 137, the first failure.
    seen["kill"] = finish(_local(cwd, *RUN, CACHE, JTRAIN_FAULT="step:5", **COMPILER_LOG))
    seen["kill_compiles"] = _compiles(cwd / "run")
    seen["entries_after_kill"] = _cache_entries(cwd)
    seen["saved"] = saved = checkpoints(cwd / "run")
    seen["summary_after_kill"] = (cwd / "run" / "summary.json").exists()

    # 2. slurm.sh under the fake srun: SLURM's SIGTERM (--signal=B:TERM) to the batch
    # script -> forwarded, both save the same step, exit 0, the job is requeued.
    slurm_log = tmp_path / "slurm.log"
    job = start(["bash", LAUNCH / "slurm.sh", *RUN, CACHE], cwd, SLURM_JOB_ID="4242",
                SLURM_NTASKS="2", SLURM_JOB_NODELIST="node[1-2]", SLURM_SUBMIT_DIR=str(cwd),
                JTRAIN_VENV=sys.prefix, FAKE_SLURM_LOG=str(slurm_log), XLA_FLAGS=TWO_DEVICES)
    wait_for_checkpoint_after(cwd / "run", saved[-1] if saved else 0, job)
    job.send_signal(signal.SIGTERM)
    seen["slurm"] = finish(job)
    seen["slurm_log"] = slurm_log.read_text()
    seen["slurm_summary"] = stopped_summary = summary(cwd / "run")
    seen["slurm_checkpoints"] = checkpoints(cwd / "run")

    # 3. The k8s container command, run as the kubelet runs it (exec form, no shell) with
    # the Job's environment (the downward API's completion index as the process id; the
    # headless Service's name replaced by loopback); the pod's SIGTERM -> exit 75.
    rc, rendered, err = finish(start(["bash", LAUNCH / "k8s" / "render.sh", "--processes=2",
                                      "--image=any", "--", *RUN, CACHE], cwd))
    assert rc == 0, err
    _, job_spec = yaml.safe_load_all(rendered)
    (container,) = job_spec["spec"]["template"]["spec"]["containers"]
    job_env = {e["name"]: e.get("value") for e in container["env"]}
    job_env["JTRAIN_COORDINATOR"] = f"127.0.0.1:{free_port()}"
    pods = [start([*container["command"], *container["args"]], cwd, XLA_FLAGS=TWO_DEVICES,
                  **{**job_env, "JTRAIN_PROCESS_ID": str(i), "JOB_COMPLETION_INDEX": str(i)})
            for i in range(job_spec["spec"]["completions"])]
    wait_for_checkpoint_after(cwd / "run", stopped_summary["step"], pods[0])
    for pod in pods:
        pod.send_signal(signal.SIGTERM)
    seen["pods"] = [finish(pod) for pod in pods]
    seen["k8s_summary"] = summary(cwd / "run")

    # 4. local.sh again: resumes and finishes, bitwise equal to the reference; with
    # --debug_multihost (both processes compare step and config hash every 10 steps).
    seen["resume"] = finish(_local(cwd, *RUN, CACHE, "--debug_multihost"))
    seen["summary"], seen["reference_summary"] = summary(cwd / "run"), summary(cwd / "ref")
    seen["train_log"] = (cwd / "run" / "train.log").read_text()
    return seen


def test_kill_term_and_resume_through_every_launcher_match_the_uninterrupted_run(journey):
    # 1. local.sh, SIGKILL at the 5th step: 137, with a checkpoint before the end.
    rc, _, err = journey["kill"]
    assert rc == 137, err
    saved = journey["saved"]
    assert saved and saved[-1] < STEPS
    assert not journey["summary_after_kill"]

    # 2. slurm.sh: the SIGTERM is forwarded, both save the same step, the job requeued.
    rc, out, err = journey["slurm"]
    assert rc == 0, err + out
    assert "coordinator 127.0.0.1:" in out and "requeueing job 4242" in out
    assert journey["slurm_log"] == "requeue 4242\n"
    assert journey["slurm_summary"]["stopped_by"] == "SIGTERM"
    stopped = journey["slurm_summary"]["step"]
    assert journey["slurm_checkpoints"][-1] == stopped < STEPS

    # 3. The k8s pods: exit 75 (--stopped_exit_code: the Job runs the index again).
    for rc, _, err in journey["pods"]:
        assert rc == 75, err
    assert journey["k8s_summary"]["step"] < STEPS

    # 4. The resumed local.sh run ends at STEPS with the reference's state.
    rc, out, err = journey["resume"]
    assert rc == 0, err + out
    assert journey["summary"]["step"] == STEPS
    assert journey["summary"]["state_sha256"] == journey["reference_summary"]["state_sha256"]
    assert "resum" in journey["train_log"].lower()
    assert "jtrain: 4 cpu device(s)" in journey["train_log"]


def test_a_second_two_process_run_compiles_nothing_in_either_process(journey):
    misses, _ = journey["reference_compiles"]
    assert misses > 0  # a fresh cache: both processes compiled (and wrote) every program
    misses, hits = journey["kill_compiles"]
    assert misses == 0 and hits > 0, (misses, hits)  # process 1's entries are read back
    assert journey["entries_after_kill"] == journey["entries"]


def test_a_stopped_peer_ends_the_survivor_with_one_line(tmp_path):
    """Process 1 SIGSTOPs itself at its 4th step: process 0 (blocked in a collective)
    names it within distributed.heartbeat_timeout_s and exits 5; local.sh returns that 5
    and does not hang on the stopped process (SIGCONT + SIGTERM, then SIGKILL)."""
    cwd = user_dir(tmp_path)
    t0 = time.monotonic()
    launcher = _local(cwd, *SYNTHETIC, "--config.total_steps=100",
                      "--config.distributed.heartbeat_timeout_s=3",
                      JTRAIN_FAULT="step:4:STOP", JTRAIN_FAULT_PROCESS="1", GRACE="10")
    rc, out, err = finish(launcher)
    assert rc == 5, err + out
    line = (cwd / "run" / "logs" / "proc_0.log").read_text().strip().splitlines()[-1]
    m = re.fullmatch(r"jtrain: peer error: peer process 1 stopped responding at step (\d+); "
                     r"last checkpoint (\d+|none); a restart resumes from the newest "
                     r"checkpoint", line)
    assert m, line
    assert 4 <= int(m.group(1)) <= 4 + 8  # at most max_steps_in_flight past the stop
    assert "Check failure" not in out + err
    assert time.monotonic() - t0 < 240
    assert not [p for p in os.listdir(cwd / "run" / "logs") if not p.endswith(".log")]


def test_tpu_vm_sigterm_reaches_jtrain_which_saves_and_exits_0(tmp_path):
    """The fake gcloud runs the worker command from $HOME (the checkout at ~/jtrain);
    a SIGTERM to that command's process (a maintenance event) is jtrain's own."""
    home = tmp_path / "home"
    checkout = user_dir(home / "jtrain")
    os.symlink(sys.prefix, checkout / ".venv")
    pids = tmp_path / "pids"
    # The worker's HOME is a fresh one: its compile cache stays the shared (warm) one.
    caches = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    proc = start(["bash", LAUNCH / "tpu_vm.sh", "my-tpu", "zone-a", *SYNTHETIC,
                  "--config.total_steps=100"], tmp_path, HOME=str(home),
                 FAKE_GCLOUD_PIDS=str(pids), JTRAIN_DISTRIBUTED="", XDG_CACHE_HOME=caches)
    wait_for_checkpoint_after(checkout / "run", 0, proc)
    (pid,) = map(int, pids.read_text().split())
    with open(f"/proc/{pid}/cmdline", "rb") as f:  # exec'ed: the worker's process is jtrain
        assert b"jtrain.main" in f.read()
    os.kill(pid, signal.SIGTERM)
    rc, out, err = finish(proc)
    assert rc == 0, err + out
    done = summary(checkout / "run")
    assert done["stopped_by"] == "SIGTERM" and checkpoints(checkout / "run")[-1] == done["step"]
