"""Real 2-process x 2-device training through each launcher, as users and schedulers run
them (subprocesses from a temp cwd, relative paths): one run interrupted four ways, by
four launchers, ends bitwise equal to the uninterrupted one; a SIGSTOPped peer ends its
survivor with one line (exit 5); tpu_vm.sh delivers a SIGTERM to jtrain itself."""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest
import yaml

from launching import (LAUNCH, TINY, checkpoints, finish, free_port, start,
                                       summary, user_dir, wait_for_checkpoint_after)

pytestmark = pytest.mark.slow

STEPS = 40  # enough steps left after each interruption for the next signal to land
RUN = [*TINY, f"--config.total_steps={STEPS}", "--config.checkpoint.every_steps=2",
       "--workdir=run"]
TWO_DEVICES = "--xla_force_host_platform_device_count=2"


def _local(cwd, *args, **env):
    return start(["bash", LAUNCH / "local.sh", 2, *args], cwd, DEVICES="2", **env)


def test_kill_term_and_resume_through_every_launcher_match_the_uninterrupted_run(tmp_path):
    cwd = user_dir(tmp_path)
    # The reference: uninterrupted, launch/local.sh, and saving no checkpoint (the saves
    # of the interrupted runs must not change the state either).
    rc, out, err = finish(_local(cwd, *TINY, f"--config.total_steps={STEPS}",
                                 "--config.checkpoint.every_steps=0", "--workdir=ref"))
    assert rc == 0, err + out
    reference = summary(cwd / "ref")["state_sha256"]

    # 1. local.sh: both processes SIGKILLed at their 5th step -> 137, the first failure.
    rc, _, err = finish(_local(cwd, *RUN, JTRAIN_FAULT="step:5"))
    assert rc == 137, err
    saved = checkpoints(cwd / "run")
    assert saved and saved[-1] < STEPS

    # 2. slurm.sh under the fake srun: SLURM's SIGTERM (--signal=B:TERM) to the batch
    # script -> forwarded, both save the same step, exit 0, the job is requeued.
    slurm_log = tmp_path / "slurm.log"
    job = start(["bash", LAUNCH / "slurm.sh", *RUN], cwd, SLURM_JOB_ID="4242",
                SLURM_NTASKS="2", SLURM_JOB_NODELIST="node[1-2]", SLURM_SUBMIT_DIR=str(cwd),
                JTRAIN_VENV=sys.prefix, FAKE_SLURM_LOG=str(slurm_log), XLA_FLAGS=TWO_DEVICES)
    wait_for_checkpoint_after(cwd / "run", saved[-1], job)
    job.send_signal(signal.SIGTERM)
    rc, out, err = finish(job)
    assert rc == 0, err + out
    assert "coordinator 127.0.0.1:" in out and "requeueing job 4242" in out
    assert slurm_log.read_text() == "requeue 4242\n"
    assert summary(cwd / "run")["stopped_by"] == "SIGTERM"
    stopped = summary(cwd / "run")["step"]
    assert checkpoints(cwd / "run")[-1] == stopped < STEPS

    # 3. The k8s container command, run as the kubelet runs it (exec form, no shell) with
    # the Job's environment (the downward API's completion index as the process id; the
    # headless Service's name replaced by loopback); the pod's SIGTERM -> exit 75.
    rc, rendered, err = finish(start(["bash", LAUNCH / "k8s" / "render.sh", "--processes=2",
                                      "--image=any", "--", *RUN], cwd))
    assert rc == 0, err
    _, job_spec = yaml.safe_load_all(rendered)
    (container,) = job_spec["spec"]["template"]["spec"]["containers"]
    job_env = {e["name"]: e.get("value") for e in container["env"]}
    job_env["JTRAIN_COORDINATOR"] = f"127.0.0.1:{free_port()}"
    pods = [start([*container["command"], *container["args"]], cwd, XLA_FLAGS=TWO_DEVICES,
                  **{**job_env, "JTRAIN_PROCESS_ID": str(i), "JOB_COMPLETION_INDEX": str(i)})
            for i in range(job_spec["spec"]["completions"])]
    wait_for_checkpoint_after(cwd / "run", stopped, pods[0])
    for pod in pods:
        pod.send_signal(signal.SIGTERM)
    for pod in pods:
        rc, _, err = finish(pod)
        assert rc == 75, err  # --stopped_exit_code: the Job runs the index again
    assert summary(cwd / "run")["step"] < STEPS

    # 4. local.sh again: resumes and finishes, bitwise equal to the reference; with
    # --debug_multihost (both processes compare step and config hash every 10 steps).
    rc, out, err = finish(_local(cwd, *RUN, "--debug_multihost"))
    assert rc == 0, err + out
    assert summary(cwd / "run")["step"] == STEPS
    assert summary(cwd / "run")["state_sha256"] == reference


def test_a_stopped_peer_ends_the_survivor_with_one_line(tmp_path):
    """Process 1 SIGSTOPs itself at its 4th step: process 0 (blocked in a collective)
    names it within distributed.heartbeat_timeout_s and exits 5; local.sh returns that 5
    and does not hang on the stopped process (SIGCONT + SIGTERM, then SIGKILL)."""
    cwd = user_dir(tmp_path)
    t0 = time.monotonic()
    launcher = _local(cwd, *RUN, "--config.total_steps=100",
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
    proc = start(["bash", LAUNCH / "tpu_vm.sh", "my-tpu", "zone-a", *RUN,
                  "--config.total_steps=100"], tmp_path, HOME=str(home),
                 FAKE_GCLOUD_PIDS=str(pids), JTRAIN_DISTRIBUTED="")
    wait_for_checkpoint_after(checkout / "run", 0, proc)
    (pid,) = map(int, pids.read_text().split())
    with open(f"/proc/{pid}/cmdline", "rb") as f:  # exec'ed: the worker's process is jtrain
        assert b"jtrain.main" in f.read()
    os.kill(pid, signal.SIGTERM)
    rc, out, err = finish(proc)
    assert rc == 0, err + out
    done = summary(checkout / "run")
    assert done["stopped_by"] == "SIGTERM" and checkpoints(checkout / "run")[-1] == done["step"]
