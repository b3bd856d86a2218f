"""The hang watchdog: a phase past its deadline ends the process with exit code 5, one
line and the stacks of all threads; beats in time keep it quiet; the `hang:N` fault and
debug.faults' hang and kill (one flag for every process, `:p1` picks the process)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time


from jtrain.control import faults
from jtrain.control.watchdog import AUTO_TIMEOUT_S, Watchdog, effective_timeout

HANG_LINE = ("jtrain: hang error: step exceeded 2 s (watchdog.timeout_s); "
             "stacks of all threads follow")


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "XLA_FLAGS", faults.FAULT_ENV)}
    env.update(JAX_PLATFORMS="cpu", **extra)
    return env


def _recording(watchdog):
    """The watchdog with its exit replaced by a record (an os._exit would end pytest)."""
    fired = []
    watchdog._fire = lambda phase, allowance: fired.append((phase, allowance))
    return fired


def test_effective_timeout_follows_the_schema_rule():
    assert effective_timeout(-1, 1) == 0  # one process: a person can stop it
    assert effective_timeout(-1, 2) == AUTO_TIMEOUT_S == 1800
    assert effective_timeout(0, 1) == effective_timeout(0, 4) == 0
    assert effective_timeout(30, 1) == effective_timeout(30, 4) == 30


def test_beats_in_time_keep_it_quiet_and_a_missed_one_fires():
    # Margins of >= 0.3 s either side: the suite shares 2 busy cores.
    with Watchdog(0.5, 1.2) as w:
        fired = _recording(w)
        for _ in range(10):  # 1 s of steps of 0.1 s, twice the timeout in all
            w.beat("step")
            time.sleep(0.1)
        w.beat("eval", 1.2)  # a longer allowance for this phase
        time.sleep(0.8)
        w.pause()  # after the loop: untimed
        time.sleep(0.8)
        assert fired == []
        w.beat("save")
        time.sleep(1.0)
        assert fired == [("save", 0.5)]  # once: the thread ends after firing


def test_start_up_is_timed_with_the_first_allowance():
    with Watchdog(0.2, 0.6) as w:
        fired = _recording(w)
        time.sleep(0.3)
        assert fired == []  # within first_timeout_s though past timeout_s
        time.sleep(0.8)
        assert fired == [("start-up", 0.6)]
    assert "watchdog.first_timeout_s" in w._message("step", 0.6)
    assert "watchdog.timeout_s" in w._message("step", 0.2)


def test_zero_timeout_is_off_no_thread():
    before = threading.active_count()
    with Watchdog(0, 10) as w:
        w.beat("step")
        assert threading.active_count() == before and w._thread is None


def test_a_stuck_thread_ends_the_process_with_5_and_all_stacks(tmp_path):
    script = textwrap.dedent("""
        import threading, time
        from jtrain.control.watchdog import Watchdog

        def stuck_in_user_code():
            time.sleep(60)

        def background_writer():
            time.sleep(60)

        threading.Thread(target=background_writer, daemon=True).start()
        with Watchdog(0.3, 5.0, log_path="hang.log", process_index=1) as w:
            w.beat("step")
            stuck_in_user_code()
    """)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 5, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0] == ("jtrain: hang error: step exceeded 0.3 s (watchdog.timeout_s); "
                        "stacks of all threads follow")
    # faulthandler's dump: every thread, the main one inside the stuck function.
    assert "stuck_in_user_code" in proc.stderr and "background_writer" in proc.stderr
    assert "Current thread" in proc.stderr or "Thread 0x" in proc.stderr
    log = (tmp_path / "hang.log").read_text()
    assert "process 1 (pid" in log and lines[0] in log and "stuck_in_user_code" in log
    assert time.monotonic() - start < 60  # it did not wait out the sleep


def test_hang_fault_sleeps_at_the_nth_step_only(monkeypatch):
    monkeypatch.setenv(faults.FAULT_ENV, "hang:2:0.3")
    faults.arm()
    try:
        took = []
        for kind in ("eval", "step", "save", "step", "step"):
            t0 = time.monotonic()
            faults.fault_point(kind)
            took.append(time.monotonic() - t0)
        assert took[3] >= 0.3 and max(took[:3] + took[4:]) < 0.1
        monkeypatch.setenv(faults.FAULT_ENV, "hang:1")
        faults.arm()
        assert faults._armed == ("hang", 1, None)  # SECONDS defaults to 3600 at the point
        monkeypatch.setenv(faults.FAULT_ENV, "step:3")
        faults.arm()
        assert faults._armed == ("step", 3, None)  # still SIGKILL, as before
    finally:
        monkeypatch.delenv(faults.FAULT_ENV)
        faults.arm()


TRAIN_ARGS = ["--config=configs/base.py:debug", "--workdir=run", "--config.total_steps=6",
              "--config.optim.warmup_steps=2",  # the debug warmup is longer than 6 steps
              # the debug model made smaller still: the processes' start and stop are tested
              "--config.model.num_layers=1", "--config.model.d_model=32",
              "--config.model.d_ff=64", "--config.eval.num_batches=1",
              "--config.watchdog.timeout_s=2", "--config.watchdog.first_timeout_s=120"]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _copy_configs(tmp_path):
    shutil.copytree(os.path.join(REPO, "configs"), tmp_path / "configs",
                    ignore=shutil.ignore_patterns("__pycache__"))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_one_hangs_both_exit(tmp_path):
    """Process 1 stops at step 3 for good (debug.faults hang@3:p1): its watchdog ends it
    with 5, the one line and the stacks of where the step stuck (also in hang.log), and
    tells the peers; process 0, blocked in the next collective, exits 5 too; neither waits
    for the hang."""
    _copy_configs(tmp_path)
    env = _env(XLA_FLAGS="--xla_force_host_platform_device_count=1",
               JTRAIN_COORDINATOR=f"127.0.0.1:{_free_port()}", JTRAIN_NUM_PROCESSES="2")
    procs = [subprocess.Popen(
        ["timeout", "-k", "5", "240", sys.executable, "-m", "jtrain.main", *TRAIN_ARGS,
         "--config.debug.faults=hang@3:p1"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**env, "JTRAIN_PROCESS_ID": str(i)}) for i in range(2)]
    outs = [p.communicate()[1] for p in procs]
    assert procs[1].returncode == 5, outs[1][-3000:]
    assert HANG_LINE in outs[1].splitlines()
    stacks = outs[1].split(HANG_LINE, 1)[1]
    assert "fault_point" in stacks and "should_stop" in stacks  # where the step stuck
    log = (tmp_path / "run" / "hang.log").read_text()
    assert HANG_LINE in log and "fault_point" in log and "process 1 (pid" in log
    # Process 0, blocked on process 1: its own watchdog (2 s) or its peer monitor, which
    # hears process 1's exit status from process 1's watchdog, ends it with 5.
    assert procs[0].returncode == 5, outs[0][-3000:]
    assert "jtrain: peer error: peer process 1 ended with exit status 5 at step " in outs[0] \
        or "jtrain: hang error: " in outs[0], outs[0][-3000:]


def test_two_processes_one_dies_the_other_exits_5_with_one_line(tmp_path):
    """Process 1 is SIGKILLed after step 3 (kill@3:p1): process 0's next collective fails, or
    its peer monitor finds process 1 silent (distributed.heartbeat_timeout_s); it names
    the peer in one line and exits 5 at once (without waiting at jax.distributed's
    shutdown for the dead peer), well before JAX's own abort."""
    _copy_configs(tmp_path)
    env = _env(XLA_FLAGS="--xla_force_host_platform_device_count=1",
               JTRAIN_COORDINATOR=f"127.0.0.1:{_free_port()}", JTRAIN_NUM_PROCESSES="2")
    args = [*TRAIN_ARGS, "--config.watchdog.timeout_s=0",  # the peer checks alone
            "--config.distributed.heartbeat_timeout_s=3", "--config.debug.faults=kill@3:p1"]
    procs = [subprocess.Popen(
        ["timeout", "-k", "5", "240", sys.executable, "-m", "jtrain.main", *args],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**env, "JTRAIN_PROCESS_ID": str(i)}) for i in range(2)]
    outs = [p.communicate()[1] for p in procs]
    assert procs[1].returncode == -9
    assert procs[0].returncode == 5, outs[0][-3000:]
    assert re.fullmatch(r"jtrain: peer error: peer process 1 stopped responding at step "
                        r"\d+; last checkpoint (\d+|none); a restart resumes from the "
                        r"newest checkpoint", outs[0].splitlines()[-1]), outs[0][-2000:]
    assert "Traceback" not in outs[0] and "Check failure" not in outs[0]
