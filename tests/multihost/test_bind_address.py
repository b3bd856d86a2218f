"""The roll call listens on the coordinator's interface, not on every interface
(127.0.0.1 stays loopback), and a peer's exit status read from JAX's key-value store is
an integer: anything else is ignored with a warning, it stops no process."""

from __future__ import annotations

import socket
import threading

import pytest

from jtrain.multihost import heartbeat, rollcall

WILDCARD = ("0.0.0.0", "::")


def test_bind_address_is_the_coordinators():
    assert rollcall.bind_address("127.0.0.1") == (socket.AF_INET, "127.0.0.1")
    family, address = rollcall.bind_address("localhost")
    assert address in ("127.0.0.1", "::1")
    assert rollcall.bind_address("no-such-host.invalid") is None


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", socket.gethostname()])
def test_listen_binds_the_coordinator_interface(host, capsys):
    server = rollcall._listen(host, 0)
    try:
        bound = server.getsockname()[0]
    finally:
        server.close()
    assert bound not in WILDCARD and bound == rollcall.bind_address(host)[1]
    assert capsys.readouterr().err == ""


def test_an_address_not_of_this_host_falls_back_with_a_line(capsys):
    server = rollcall._listen("192.0.2.1", 0)  # TEST-NET-1: no machine owns it
    try:
        assert server.getsockname()[0] in WILDCARD
    finally:
        server.close()
    assert "not an address of this machine" in capsys.readouterr().err


def test_the_roll_call_completes_on_loopback():
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    address = f"127.0.0.1:{port}"
    errors = []

    def host():
        try:
            rollcall.gather(address, 2, 0, 20.0)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=host)
    thread.start()
    rollcall.gather(address, 2, 1, 20.0)
    thread.join(30)
    assert not errors and not thread.is_alive()


def test_exit_status_is_an_integer_or_ignored(capsys):
    assert heartbeat.exit_status("jtrain/exit/1", "0") == 0
    assert heartbeat.exit_status("jtrain/exit/1", " 3\n") == 3
    assert heartbeat.exit_status("jtrain/exit/1", b"5") == 5
    for value in ("abc", "", "99999999999", "1.5", "0x1"):
        assert heartbeat.exit_status("jtrain/exit/7", value) is None
    err = capsys.readouterr().err
    assert err.count("jtrain: warning: ignoring jtrain/exit/7") == 1, err  # once per key


class _Store:
    """A key-value store whose EXIT folder holds `exits`; it stops the monitor at its
    second beat."""

    def __init__(self, monitor_ref, exits):
        self.ref, self.exits, self.beats = monitor_ref, exits, 0

    def key_value_set(self, *args, **kwargs):
        self.beats += 1
        if self.beats > 1:
            self.ref[0]._stop.set()

    def key_value_dir_get(self, prefix):
        return list(self.exits.items()) if prefix == heartbeat.EXIT else []


@pytest.mark.parametrize("value, fails", [("garbage", False), ("3", True), ("0", False)])
def test_a_non_integer_exit_value_stops_no_process(monkeypatch, value, fails):
    failed = []
    monkeypatch.setattr(heartbeat, "fail", failed.append)
    ref = [None]
    monitor = heartbeat.PeerMonitor(_Store(ref, {f"{heartbeat.EXIT}1": value}), 0, 2, 1.0)
    ref[0] = monitor
    monitor._beat()
    assert bool(failed) == fails, failed
    assert (1 in monitor._done) == (value != "garbage")  # an integer: that peer is done


def test_jax_binds_the_same_interface():
    assert rollcall.local_bind_address("127.0.0.1:1234") == "127.0.0.1:1234"
    assert rollcall.local_bind_address("localhost:99") in ("127.0.0.1:99", "[::1]:99")
    assert rollcall.local_bind_address("192.0.2.1:1234") is None  # JAX's default then


@pytest.mark.parametrize("env, want", [(None, "127.0.0.1:1234"), ("[::]:1234", None)])
def test_start_hands_jax_the_coordinator_interface(monkeypatch, env, want):
    import jax

    from jtrain.multihost import start

    seen = {}

    class Monitor:
        def __init__(self, *args):
            pass

        def start(self):
            return self

    monkeypatch.setattr(start.heartbeat, "PeerMonitor", Monitor)
    monkeypatch.setattr(start.rollcall, "gather", lambda *a: None)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: seen.update(kw))
    if env:  # the user's own choice wins (JAX reads it)
        monkeypatch.setenv("JAX_COORDINATOR_BIND_ADDRESS", env)
    start.start({"distributed": {"init_timeout_s": 40}}, "127.0.0.1:1234", 2, 0)
    assert seen["coordinator_bind_address"] == want


def _free_address() -> str:
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    return f"127.0.0.1:{port}"


def test_with_a_token_a_stranger_is_not_counted_and_the_launch_goes_on(monkeypatch):
    """With JTRAIN_ROLLCALL_TOKEN, a check-in that has the right form but not the token
    (a stranger who knows the port) is not counted: process 0 waits on for the real
    process 1, which carries the token."""
    monkeypatch.setenv(rollcall.TOKEN_ENV, "s3cret-token")
    address = _free_address()
    done, errors = [], []

    def host():
        try:
            rollcall.gather(address, 2, 0, 20.0)
            done.append(True)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=host)
    thread.start()
    host_ip, port = address.rsplit(":", 1)
    for _ in range(80):  # the stranger: the right words, no token
        try:
            stranger = socket.create_connection((host_ip, int(port)), timeout=1.0)
            break
        except OSError:
            threading.Event().wait(0.05)
    stranger.sendall(f"{rollcall.MAGIC} 1 2\n".encode())
    stranger.settimeout(5.0)
    assert stranger.recv(64) == b""  # closed without a "go"
    stranger.close()
    assert not done
    rollcall.gather(address, 2, 1, 20.0)  # the real process 1, with the token
    thread.join(30)
    assert done and not errors

