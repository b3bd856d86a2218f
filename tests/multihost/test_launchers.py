"""The launch/ recipes as their users run them: local.sh's exit status and signal path
(with a stand-in for jtrain, so each case takes a second), the start-up failures in
one line (real jtrain: a bad key on both, a busy port, a missing peer, --distributed=auto
outside a cluster, a gs:// workdir), slurm.sh / k8s / tpu_vm.sh argument checks.
The training runs through each launcher are in test_launch_runs.py."""

from __future__ import annotations

import re
import signal
import socket
import time

import pytest
import yaml

from launching import (FAKE_BIN, LAUNCH, TINY, finish, free_port, start,
                                       user_dir)

FAKE = str(FAKE_BIN / "fake_jtrain")


def _local(tmp_path, *, timeout=60, **fake):
    proc = start(["bash", LAUNCH / "local.sh", 2, "--workdir=run"], tmp_path,
                 PYTHON=FAKE, GRACE="5", **fake)
    return proc, finish(proc, timeout)


@pytest.mark.parametrize("fake, status", [
    ({"FAKE_0": "exit 0", "FAKE_1": "exit 0"}, 0),
    ({"FAKE_1": "exit 7"}, 7),  # process 0 sleeps 30 s: noticed at once, not after it
    ({"FAKE_0": "late 3", "FAKE_1": "exit 4"}, 4),  # the first to fail, not process 0
    ({"FAKE_1": "kill"}, 137),  # SIGKILL: 128 + 9
    ({"FAKE_0": "exit 5", "FAKE_1": "stop"}, 5),  # a SIGSTOPped peer does not hang it
])
def test_local_sh_returns_the_first_failing_status_at_once(tmp_path, fake, status):
    t0 = time.monotonic()
    _, (rc, out, err) = _local(tmp_path, **fake)
    assert rc == status, (out, err)
    assert time.monotonic() - t0 < 20  # the sleeping process was stopped, not waited for
    logs = {i: (tmp_path / "run" / "logs" / f"proc_{i}.log").read_text() for i in (0, 1)}
    if status:
        assert "stopping the others" in err
        # the survivor got SIGTERM (a stopped one after a SIGCONT); `late` ignores it
        assert any("got TERM" in log for log in logs.values()) != ("late" in str(fake)), logs


def test_local_sh_forwards_sigterm_to_every_process(tmp_path):
    proc = start(["bash", LAUNCH / "local.sh", 2, "--workdir=run"], tmp_path, PYTHON=FAKE)
    logs = [tmp_path / "run" / "logs" / f"proc_{i}.log" for i in (0, 1)]
    log1 = logs[1]
    deadline = time.monotonic() + 20  # both have set their traps (they print after it)
    while (not all(log.exists() and log.read_text() for log in logs)
           and time.monotonic() < deadline):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    rc, out, err = finish(proc, 30)
    assert rc == 0, err
    assert "process 0 got TERM" in out  # process 0's log is printed when not a terminal
    assert "process 1 got TERM" in log1.read_text()
    assert "process 0 of 2 at 127.0.0.1:" in out


def test_local_sh_usage_errors_are_one_line(tmp_path):
    proc = start(["bash", LAUNCH / "local.sh", "two", "--workdir=run"], tmp_path)
    rc, _, err = finish(proc, 30)
    assert rc == 2 and err.strip().splitlines() == [
        "launch/local.sh: NUM_PROCESSES must be a positive integer, got 'two'"]
    proc = start(["bash", LAUNCH / "local.sh", "2", "--config=x.py"], tmp_path)
    rc, _, err = finish(proc, 30)
    assert rc == 2 and err.strip() == "launch/local.sh: --workdir=DIR is required"


@pytest.mark.slow
def test_start_up_failures_are_one_line(tmp_path):
    """Real jtrain, 2 processes: a bad key on both (exit 2), a busy coordinator port and a
    peer that never comes (exit 5, the line naming the coordinator and the ids)."""
    cwd = user_dir(tmp_path)
    rc, _, err = finish(start(["bash", LAUNCH / "local.sh", 2, *TINY, "--workdir=bad",
                               "--config.optim.lr=-1"], cwd), 300)
    assert rc == 2, err
    for i in (0, 1):  # before either waited for the other
        log = (cwd / "bad" / "logs" / f"proc_{i}.log").read_text().strip().splitlines()
        assert log == ["jtrain: config error: optim.lr: must be >= 0.0, got -1.0"], log
    with socket.socket() as busy:  # a port someone else listens on
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        taken = start(["bash", LAUNCH / "local.sh", 2, *TINY, "--workdir=busy"], cwd,
                      PORT=str(port))
        rc, _, err = finish(taken, 300)
    assert rc == 5, err
    log0 = (cwd / "busy" / "logs" / "proc_0.log").read_text().strip().splitlines()
    assert log0[-1] == (f"jtrain: peer error: start-up: the coordinator port {port} "
                        f"(127.0.0.1:{port}) is already in use on this host (another run?); "
                        "choose another port (--coordinator_address, or PORT= for "
                        "launch/local.sh)")
    # Process 1 of 2 alone: nobody at the coordinator; exit 5 within the init timeout.
    addr = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    alone = start(["python", "-m", "jtrain.main", *TINY, "--workdir=alone",
                   "--config.distributed.init_timeout_s=3"], cwd, JTRAIN_COORDINATOR=addr,
                  JTRAIN_NUM_PROCESSES="2", JTRAIN_PROCESS_ID="1")
    rc, _, err = finish(alone, 300)
    assert rc == 5, err
    assert err.strip().splitlines()[-1] == (
        f"jtrain: peer error: start-up: process 1 could not reach the coordinator {addr} "
        "(process 0) within 3 s (distributed.init_timeout_s): expected process ids 0, 1")
    assert time.monotonic() - t0 < 120  # imports + 3 s, not JAX's 300 s
    assert "Traceback" not in err and "Check failure" not in err


@pytest.mark.slow
def test_missing_peer_preflight_mismatch_and_auto_outside_a_cluster(tmp_path):
    cwd = user_dir(tmp_path)
    addr = f"127.0.0.1:{free_port()}"
    procs = [start(["python", "-m", "jtrain.main", *TINY, "--workdir=run",
                    "--config.distributed.init_timeout_s=4"], cwd, JTRAIN_COORDINATOR=addr,
                   JTRAIN_NUM_PROCESSES="3", JTRAIN_PROCESS_ID=str(i)) for i in (0, 2)]
    auto = start(["python", "-m", "jtrain.main", *TINY, "--workdir=auto",
                  "--distributed=auto"], cwd)
    # Preflight: two processes started with different configs (another seed).
    other = f"127.0.0.1:{free_port()}"
    mixed = [start(["python", "-m", "jtrain.main", *TINY, "--workdir=mixed",
                    f"--config.seed={i}"], cwd, JTRAIN_COORDINATOR=other,
                   JTRAIN_NUM_PROCESSES="2", JTRAIN_PROCESS_ID=str(i),
                   XLA_FLAGS="--xla_force_host_platform_device_count=1") for i in (0, 1)]
    line = (f"jtrain: peer error: start-up: not every process reached the coordinator "
            f"{addr} within 4 s (distributed.init_timeout_s): expected process ids 0, 1, 2, "
            "joined 0, 2")
    for proc in procs:  # both say who is missing; the one that came hears it from 0
        rc, _, err = finish(proc, 300)
        assert (rc, err.strip().splitlines()[-1]) == (5, line), err
    for proc in mixed:
        rc, _, err = finish(proc, 300)
        assert rc == 5, err
        assert re.fullmatch(r"jtrain: peer error: preflight: process 1 has config_hash "
                            r"[0-9a-f]{64}, process 0 has [0-9a-f]{64}; every process must "
                            r"run the same config and jtrain on the same number of devices",
                            err.strip().splitlines()[-1]), err[-2000:]
    rc, _, err = finish(auto, 300)
    assert rc == 2 and err.strip().splitlines() == [
        "jtrain: usage error: --distributed=auto: no SLURM job or Cloud TPU slice found "
        "here; use launch/local.sh, or pass --coordinator_address, --num_processes and "
        "--process_id"]


def test_tpu_vm_refuses_a_remote_workdir_before_any_ssh(tmp_path):
    pids = tmp_path / "pids"
    proc = start(["bash", LAUNCH / "tpu_vm.sh", "my-tpu", "zone-a", *TINY,
                  "--workdir=gs://bucket/runs/x"], tmp_path, FAKE_GCLOUD_PIDS=str(pids),
                 HOME=str(tmp_path))
    rc, _, err = finish(proc, 30)
    assert rc == 2 and err.strip().splitlines() == [
        "launch/tpu_vm.sh: gs://bucket/runs/x is a remote URI; jtrain writes the workdir "
        "with local file I/O: mount it (gcsfuse) and pass the mounted path"]
    assert not pids.exists()  # gcloud never ran
    assert not (tmp_path / "gs:").exists()


def test_tpu_vm_and_slurm_put_no_uri_password_on_a_command_line(tmp_path):
    pids = tmp_path / "pids"
    secret = "--tune.storage=postgresql://svc:Pw'x9!@db:5432/app"
    for script, extra, env in (("tpu_vm.sh", ["my-tpu", "zone-a"],
                                {"FAKE_GCLOUD_PIDS": str(pids), "HOME": str(tmp_path)}),
                               ("slurm.sh", [], {"SLURM_JOB_ID": "7"})):
        proc = start(["bash", LAUNCH / script, *extra, *TINY, "--workdir=run", secret],
                     tmp_path, **env)
        rc, _, err = finish(proc, 30)
        assert rc == 2 and err.strip().startswith(
            f"launch/{script}: an argument holds a URI with a password;"), err
        assert "Pw'x9" not in err
    assert not pids.exists()  # gcloud never ran


def test_slurm_sh_needs_its_venv_and_a_job(tmp_path):
    proc = start(["bash", LAUNCH / "slurm.sh", "--workdir=run"], tmp_path,
                 SLURM_JOB_ID="7", SLURM_SUBMIT_DIR=str(tmp_path))
    rc, _, err = finish(proc, 30)
    assert rc == 2 and err.strip() == (
        f"launch/slurm.sh: no python in JTRAIN_VENV={tmp_path}/.venv; create the venv "
        "(README) or set JTRAIN_VENV")
    text = (LAUNCH / "slurm.sh").read_text()
    # SIGTERM early enough for checkpoint.grace_seconds (30 s by default) to save; requeue
    assert "#SBATCH --signal=B:TERM@120" in text and "#SBATCH --requeue" in text


def test_k8s_render_derives_every_count_from_one_number(tmp_path):
    proc = start(["bash", LAUNCH / "k8s" / "render.sh", "--processes=3", "--image=reg/jt:1",
                  "--grace=45", "--", "--config=configs/base.py", "--workdir=/runs/it's"],
                 tmp_path)
    rc, out, err = finish(proc, 30)
    assert rc == 0, err
    service, job = yaml.safe_load_all(out)
    spec = job["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    envs = {e["name"]: e for e in container["env"]}
    assert spec["completions"] == spec["parallelism"] == 3
    assert envs["JTRAIN_NUM_PROCESSES"]["value"] == "3"
    assert envs["JTRAIN_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert envs["JTRAIN_COORDINATOR"]["value"] == "jtrain-0.jtrain:1234"
    assert pod["subdomain"] == service["metadata"]["name"] == "jtrain"
    assert container["command"] == ["python", "-m", "jtrain.main"]  # exec form: no shell
    assert container["args"] == ["--config=configs/base.py", "--workdir=/runs/it's",
                                 "--stopped_exit_code=75",
                                 "--config.checkpoint.grace_seconds=45"]
    assert pod["terminationGracePeriodSeconds"] == 75  # grace + 30 s to exit
    assert pod["restartPolicy"] == "Never" and spec["backoffLimit"] > 0
    rules = spec["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onExitCodes": {"containerName": "jtrain", "operator": "In",
                                                "values": [75]}} in rules
    bad = start(["bash", LAUNCH / "k8s" / "render.sh", "--image=x"], tmp_path)
    rc, _, err = finish(bad, 30)
    assert rc == 2 and err.strip() == \
        "launch/k8s/render.sh: --processes=N (a positive integer) is required"



def test_ray_job_puts_no_secret_on_a_workers_command_line(monkeypatch, capsys):
    """A password in ARGS would reach every worker's argv: refused in one line, exit 2,
    before Ray starts; the environment carries it (JTRAIN_* goes to every process)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("ray_job", LAUNCH / "ray_job.py")
    ray_job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ray_job)
    monkeypatch.setitem(sys.modules, "ray", None)  # were Ray reached, its import fails
    for secret in ("--tune.storage=postgresql://svc:Pw'x9!@db/app",
                   "--config.data.kwargs.api_key=K3yK3yK3y"):
        rc = ray_job.main(["--num_workers=2", "--", "--config=c.py", "--workdir=w", secret])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1, err
        assert err[0].startswith("ray_job: --") and "<redacted>" in err[0], err
        assert "Pw'x9" not in err[0] and "K3yK3yK3y" not in err[0]
    monkeypatch.setenv("JTRAIN_TUNE_DB_PASSWORD", "Pw'x9!")
    args = ray_job.parse(["--num_workers=2", "--", "--config=c.py", "--workdir=w",
                          "--tune.storage=postgresql://svc@db/app"])
    assert ray_job.secret_in_argv(args.jtrain) is None
    env = ray_job.Job(args).env(1, "h:1", "tok")
    assert env["JTRAIN_TUNE_DB_PASSWORD"] == "Pw'x9!"
