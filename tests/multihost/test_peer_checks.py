"""The peer checks against an in-memory stand-in for JAX's coordination-service store
(the real store is exercised by the multi-process tests): preflight mismatches, the
--debug_multihost step check, the monitor's silent-peer and exit-status rules, the
distributed.* timeouts read before the runtime starts."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from jtrain import internals
from jtrain.errors import ConfigError, PeerError
from jtrain.multihost import heartbeat as monitor, preflight, start


class Store:
    """The part of jax's DistributedRuntimeClient the checks use, shared by 'processes'."""

    def __init__(self):
        self.kv: dict[str, str] = {}
        self.lock = threading.Lock()

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.lock:
            assert allow_overwrite or key not in self.kv
            self.kv[key] = value

    def key_value_dir_get(self, prefix):
        with self.lock:
            return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]

    def blocking_key_value_get(self, key, timeout_ms):
        deadline = time.monotonic() + timeout_ms / 1000
        while time.monotonic() < deadline:
            with self.lock:
                if key in self.kv:
                    return self.kv[key]
            time.sleep(0.01)
        raise RuntimeError("DEADLINE_EXCEEDED")


class Cfg:
    class distributed:  # noqa: N801 - stands for cfg.distributed
        heartbeat_timeout_s = 0.3


@pytest.fixture
def two_processes(monkeypatch):
    """This test is process 0 of 2; process 1's reports are put in the store by hand."""
    import jax

    store = Store()
    monkeypatch.setattr(internals, "distributed_client", lambda: store)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    return store


def _peer_report(store, **changes):
    import jax

    import jtrain

    report = {"config_hash": "abc", "local_devices": jax.local_device_count(),
              "jtrain_version": jtrain.__version__, "host": socket.gethostname(), **changes}
    store.key_value_set(f"{preflight.PREFLIGHT}1", json.dumps(report), allow_overwrite=True)


def test_preflight_passes_when_all_agree_and_names_the_first_difference(two_processes):
    _peer_report(two_processes)
    preflight.run(Cfg, "abc")
    _peer_report(two_processes, config_hash="xyz")
    two_processes.kv.pop(f"{preflight.PREFLIGHT}0")
    with pytest.raises(PeerError, match=r"^preflight: process 1 has config_hash xyz, "
                                        r"process 0 has abc; every process must run"):
        preflight.run(Cfg, "abc")
    _peer_report(two_processes, jtrain_version="0.0.1")
    with pytest.raises(PeerError, match="process 1 has jtrain_version 0.0.1"):
        preflight.run(Cfg, "abc")


def test_preflight_refuses_loopback_coordinator_across_hosts(two_processes, monkeypatch):
    monkeypatch.setattr(internals, "coordinator_address", lambda: "127.0.0.1:1234")
    _peer_report(two_processes, host="another-host")
    with pytest.raises(PeerError, match=r"coordinator address 127.0.0.1:1234 is a loopback "
                                        r"address but the processes run on 2 hosts"):
        preflight.run(Cfg, "abc")


def test_preflight_names_a_peer_that_never_reports(two_processes):
    with pytest.raises(PeerError, match=r"^preflight: process 1 did not report within "
                                        r"0.3 s \(distributed.heartbeat_timeout_s\)"):
        preflight.run(Cfg, "abc")


def test_debug_multihost_step_check(two_processes):
    two_processes.key_value_set(f"{preflight.STEP}10/1", "abc")
    preflight.check_step(10, Cfg, "abc")
    two_processes.key_value_set(f"{preflight.STEP}20/1", "other")
    with pytest.raises(PeerError, match=r"--debug_multihost at step 20: process 1 has "
                                        r"config hash other"):
        preflight.check_step(20, Cfg, "abc")
    with pytest.raises(PeerError, match=r"--debug_multihost at step 30: process 1 did not "
                                        r"report"):  # process 1 is at another step
        preflight.check_step(30, Cfg, "abc")


def test_monitor_finds_the_silent_peer_and_ignores_a_finished_one(monkeypatch):
    store = Store()
    failed = []
    monkeypatch.setattr(monitor, "fail", lambda what: failed.append(what) or
                        threading.Event().wait())  # the real one exits the process
    mon = monitor.PeerMonitor(store, 0, 3, timeout_s=1.0)
    try:
        mon.start()
        for _ in range(8):  # process 1 beats; process 2 finished cleanly
            store.key_value_set(f"{monitor.ALIVE}1", str(time.monotonic()), allow_overwrite=True)
            store.key_value_set(f"{monitor.EXIT}2", "0", allow_overwrite=True)
            time.sleep(0.1)
        assert failed == [] and mon.stale(0.5) == []
        time.sleep(1.6)  # process 1 goes silent
        assert failed[:1] == ["peer process 1 stopped responding"]
    finally:
        mon.stop(0)
        monitor._monitor = None
    assert store.kv[f"{monitor.EXIT}0"] == "0"


def test_monitor_reports_a_peer_that_exited_with_an_error(monkeypatch):
    store = Store()
    failed = []
    monkeypatch.setattr(monitor, "fail", lambda what: failed.append(what) or
                        threading.Event().wait())
    store.key_value_set(f"{monitor.EXIT}1", "5")
    mon = monitor.PeerMonitor(store, 0, 2, timeout_s=5.0)
    try:
        mon.start()
        deadline = time.monotonic() + 5
        while not failed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert failed[:1] == ["peer process 1 ended with exit status 5"]
    finally:
        mon.stop(0)
        monitor._monitor = None


def test_the_line_says_where_the_run_was(monkeypatch, capfd):
    monkeypatch.setattr(monitor.os, "_exit", lambda code: (_ for _ in ()).throw(
        SystemExit(code)))
    monitor.note_step(57)
    monitor.note_checkpoint(50)
    with pytest.raises(SystemExit) as e:
        monitor.fail("peer process 1 stopped responding")
    monitor._fired.release()
    assert e.value.code == 5
    assert capfd.readouterr().err == (
        "jtrain: peer error: peer process 1 stopped responding at step 57; last checkpoint "
        "50; a restart resumes from the newest checkpoint\n")


def test_timeouts_come_from_config_with_defaults():
    assert start.timeouts({}) == (900.0, 120.0)
    assert start.timeouts({"distributed": {"init_timeout_s": 5, "heartbeat_timeout_s": 2.5}}) \
        == (5.0, 2.5)
    with pytest.raises(ConfigError, match=r"^distributed.heartbeat_timeout_s: must be a "
                                          r"number of seconds in \[1, 86400\], got 0"):
        start.timeouts({"distributed": {"heartbeat_timeout_s": 0}})


@pytest.mark.parametrize("heartbeat", [3, 7.5])
def test_start_hands_the_configured_heartbeat_to_the_monitor_and_to_jax(monkeypatch,
                                                                       heartbeat):
    """distributed.heartbeat_timeout_s is the silence after which jtrain's peer monitor
    names a dead peer; JAX's own heartbeat is set longer (2x + a margin) so that line comes
    first. A dead-peer run cannot tell (its collective fails first), so this checks the
    wiring: the values start() hands on, from a config with a non-default timeout."""
    import jax

    seen = {}
    peers = next(m for m in vars(start).values() if hasattr(m, "PeerMonitor"))

    class Monitor:
        def __init__(self, client, process_id, num_processes, timeout_s):
            seen["monitor"] = (process_id, num_processes, timeout_s)

        def start(self):
            return self

    monkeypatch.setattr(peers, "PeerMonitor", Monitor)
    monkeypatch.setattr(start.rollcall, "gather", lambda *a: seen.setdefault("gather", a))
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: seen.update(jax=kw))
    start.start({"distributed": {"heartbeat_timeout_s": heartbeat, "init_timeout_s": 40}},
                "127.0.0.1:1234", 2, 1)
    assert seen["monitor"] == (1, 2, heartbeat)
    assert seen["jax"]["heartbeat_timeout_seconds"] == int(2 * heartbeat) + 10
    assert seen["jax"]["initialization_timeout"] == 41
    assert seen["gather"] == ("127.0.0.1:1234", 2, 1, 40.0)
