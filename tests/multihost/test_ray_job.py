"""launch/ray_job.py on a real local Ray cluster (one per test: Ray's start-up is the cost):
two jtrain processes as one job, process 1 killed mid-run by a fault, the driver restarts
the whole group, the run resumes from its workdir and ends bitwise equal to an
uninterrupted 2-process run of launch/local.sh; the driver shuts its cluster down and
leaves no process behind. The local command of docs/guide/multi-host.md ("Ray"), with a
smaller model and the fault."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from launching import LAUNCH, TINY, env, finish, start, summary, user_dir

pytestmark = pytest.mark.slow

STEPS = 12
RUN = [*TINY, f"--config.total_steps={STEPS}", "--config.debug.hash_every_steps=4"]


def _hashes(workdir) -> dict:
    """{step: (state digest, example indices)} of WORKDIR/hashes.jsonl (a recomputed
    step: its last record)."""
    out = {}
    for line in (workdir / "hashes.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = (rec["hash"], rec["examples"])
    return out


def _marked(marker: str) -> list[int]:
    """Processes whose environment carries `marker` (the cluster's RAY_TMPDIR): Ray's own
    processes, its workers and the jtrain processes they started."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_a_killed_worker_restarts_the_group_which_resumes_bitwise(tmp_path):
    cwd = user_dir(tmp_path)
    # The reference: launch/local.sh, uninterrupted, no checkpoints.
    rc, out, err = finish(start(["bash", LAUNCH / "local.sh", 2, *RUN,
                                 "--config.checkpoint.every_steps=0", "--workdir=ref"], cwd))
    assert rc == 0, err + out

    # Ray's sockets live under its temp dir, whose path must stay short; its value also
    # marks every process of this cluster. RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps the
    # cluster on 127.0.0.1 (the node address, hence the coordinator's). RAY_AUTH_TOKEN:
    # the cluster's token given, so Ray does not write one into the home directory.
    ray_tmp = tempfile.mkdtemp(prefix="jtray")
    driver = subprocess.Popen(
        [sys.executable, str(LAUNCH / "ray_job.py"), "--num_workers=2", "--address=local",
         "--cpu_devices=1", "--grace_s=3", "--", *RUN, "--config.checkpoint.every_steps=2",
         "--config.debug.faults=kill@7:p1", "--workdir=run"],
        cwd=cwd, env=env(RAY_TMPDIR=ray_tmp, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
                RAY_AUTH_TOKEN=secrets.token_hex(16)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        rc, out, err = finish(driver, timeout=420)
        deadline = time.monotonic() + 20
        while _marked(ray_tmp) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = _marked(ray_tmp)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
        for pid in _marked(ray_tmp):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert rc == 0, err + out
    assert not left, f"processes left behind: {left}"

    # Process 1 died by the fault (SIGKILL: 137), the group started again, coordinator on
    # loopback each time.
    assert re.search(r"ray_job: process 1 exited with status 137; stopping the others", err)
    attempts = re.findall(r"ray_job: attempt (\d): 2 processes, coordinator 127\.0\.0\.1:\d+",
                          err)
    assert attempts == ["1", "2"], err
    faults = [json.loads(ln) for ln in (cwd / "run" / "faults.jsonl").read_text().splitlines()]
    assert [(f["fault"], f["process"]) for f in faults] == [("kill@7:p1", 1)]
    done = summary(cwd / "run")
    assert done["step"] == STEPS and 0 < done["resumed_from"] < 7
    assert "jtrain: done at step 12" in out
    # Bitwise: the final state and every recorded state equal the uninterrupted run's.
    assert done["state_sha256"] == summary(cwd / "ref")["state_sha256"]
    assert sorted(_hashes(cwd / "ref")) == [4, 8, 12]
    assert _hashes(cwd / "run") == _hashes(cwd / "ref")
    logs = (cwd / "run" / "logs" / "proc_1.log").read_text()
    assert logs.count("ray_job: attempt ") == 2
