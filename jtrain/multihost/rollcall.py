"""The roll call: before `jax.distributed.initialize`, process 0 listens on the
coordinator's port and every other process checks in there. Process 0 answers `go` once
all `num_processes` have checked in, or, when `distributed.init_timeout_s` runs out,
`fail <joined ids>`, and every process prints the same line naming the coordinator
address, the expected and the joined process ids, and exits 5. Without it JAX waits its
own initialization timeout and then aborts in C++ (exit 134, no line naming anyone).

With `JTRAIN_ROLLCALL_TOKEN` set (launch/local.sh and launch/slurm.sh draw a random one
per launch and give it to every process), a check-in must carry it: a stranger on the
network who knows the port cannot take a process's place in the roll call.

Process 0 listens on the coordinator's interface only (the address its host name
resolves to: 127.0.0.1 stays loopback), not on every interface. It then closes the port
and JAX's coordination service binds it; the others have closed their side first, so no
connection of ours lingers on it.
"""

from __future__ import annotations

import errno
import hmac
import os
import socket
import sys
import time

from jtrain.errors import PeerError

MAGIC = "jtrain-rollcall"
RETRY_S = 0.25  # between attempts to reach the coordinator
TOKEN_ENV = "JTRAIN_ROLLCALL_TOKEN"  # the launch's shared secret, when it draws one


def _token() -> str:
    return os.environ.get(TOKEN_ENV, "").strip()


def _interrupted() -> None:
    """A SIGTERM / SIGINT while waiting for peers (recorded by jtrain.boot for the CLI):
    stop here, exit 0, as for any signal during start-up (nothing to save)."""
    from jtrain import boot

    name = boot.early_signal()
    if name:
        sys.stderr.write(f"jtrain: {name} received during start-up (waiting for the other "
                         "processes): stopping, nothing to save\n")
        raise SystemExit(0)


def _ids(ids) -> str:
    ids = sorted(ids)
    return ", ".join(map(str, ids)) if ids else "none"


def _missing_line(address: str, n: int, joined, timeout_s: float) -> str:
    return (f"start-up: not every process reached the coordinator {address} within "
            f"{timeout_s:g} s (distributed.init_timeout_s): expected process ids "
            f"{_ids(range(n))}, joined {_ids(joined)}")


def _port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise PeerError(f"coordinator address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def gather(address: str, num_processes: int, process_id: int, timeout_s: float) -> None:
    """Returns once all processes have checked in; else raises PeerError (the line)."""
    if num_processes <= 1:
        return
    if process_id == 0:
        _host(address, num_processes, timeout_s)
    else:
        _join(address, num_processes, process_id, timeout_s)


def bind_address(host: str) -> tuple[int, str] | None:
    """(family, address) the roll call listens on: the address the coordinator's host
    name resolves to first, so the port sits on the coordinator's interface only
    (127.0.0.1 stays loopback); None when the name does not resolve here."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return None
    family, _, _, _, sockaddr = infos[0]
    return family, str(sockaddr[0])


def local_bind_address(address: str) -> str | None:
    """"ip:port" ("[ip]:port" for IPv6) of the coordinator's interface for JAX's
    coordination service (`coordinator_bind_address`), None when that address is not one
    of this machine's (JAX then listens on all interfaces, as the roll call does)."""
    host, port = _port(address)
    found = bind_address(host)
    if found is None:
        return None
    family, ip = found
    try:
        socket.create_server((ip, 0), family=family).close()
    except OSError:
        return None
    return f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"


def _listen(host: str, port: int) -> socket.socket:
    """A server on the coordinator's interface (`bind_address`). An address this host does
    not own (a name for a load balancer or a NAT) falls back to all interfaces, said in one
    line: the peers must reach the port through it."""
    found = bind_address(host)
    if found is not None:
        family, address = found
        try:
            return socket.create_server((address, port), family=family)
        except OSError as e:
            if e.errno != errno.EADDRNOTAVAIL:
                raise
    sys.stderr.write(f"jtrain: warning: the coordinator host {host!r} is not an address of "
                     f"this machine; the roll call listens on port {port} of all its "
                     "interfaces\n")
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", port))


def _host(address: str, n: int, timeout_s: float) -> None:
    host, port = _port(address)
    try:
        server = _listen(host, port)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise PeerError(f"start-up: the coordinator port {port} ({address}) is already "
                            "in use on this host (another run?); choose another port "
                            "(--coordinator_address, or PORT= for launch/local.sh)") from None
        raise PeerError(f"start-up: cannot listen on the coordinator port {port} "
                        f"({address}): {e.strerror or e}") from None
    joined: dict[int, socket.socket] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(joined) < n - 1 and (left := deadline - time.monotonic()) > 0:
            _interrupted()
            server.settimeout(min(left, RETRY_S))
            try:
                conn, _ = server.accept()
            except (TimeoutError, socket.timeout):
                continue
            pid = _read_checkin(conn, n, deadline)
            if pid is None or pid in joined:
                conn.close()
                continue
            joined[pid] = conn
        ok = len(joined) == n - 1
        answer = "go\n" if ok else f"fail {','.join(map(str, sorted(joined) + [0]))}\n"
        for conn in joined.values():
            try:
                conn.sendall(answer.encode())
            except OSError:
                pass
        for conn in joined.values():  # they close first: no TIME_WAIT on our port
            try:
                conn.settimeout(5.0)
                conn.recv(16)
            except OSError:
                pass
            conn.close()
    finally:
        server.close()
    if not ok:
        raise PeerError(_missing_line(address, n, [0, *joined], timeout_s))


def _read_checkin(conn: socket.socket, n: int, deadline: float) -> int | None:
    """The id in `jtrain-rollcall <id> <n> [<token>]`, or None for anything else (a
    stranger, or a check-in without this launch's token)."""
    try:
        conn.settimeout(max(0.1, min(5.0, deadline - time.monotonic())))
        words = conn.recv(256).decode(errors="replace").split()
    except OSError:
        return None
    token = _token()
    if len(words) != (4 if token else 3) or (
            token and not hmac.compare_digest(words[3].encode(), token.encode())):
        return None
    if words[0] == MAGIC and words[1].isascii() and words[1].isdigit() and words[2] == str(n):
        pid = int(words[1])
        return pid if 0 < pid < n else None
    return None


def _join(address: str, n: int, process_id: int, timeout_s: float) -> None:
    host, port = _port(address)
    deadline = time.monotonic() + timeout_s
    while True:
        _interrupted()
        left = deadline - time.monotonic()
        if left <= 0:
            raise PeerError(f"start-up: process {process_id} could not reach the coordinator "
                            f"{address} (process 0) within {timeout_s:g} s "
                            f"(distributed.init_timeout_s): expected process ids "
                            f"{_ids(range(n))}")
        try:
            conn = socket.create_connection((host, port), timeout=min(left, 5.0))
        except OSError:
            time.sleep(min(RETRY_S, max(left, 0)))
            continue
        with conn:
            try:
                token = _token()
                conn.sendall(f"{MAGIC} {process_id} {n}{' ' + token if token else ''}\n"
                             .encode())
                answer = _answer(conn, deadline)
            except OSError:
                answer = []
        if answer[:1] == ["go"]:
            return
        if answer[:1] == ["fail"] and len(answer) == 2:
            joined = [int(x) for x in answer[1].split(",") if x.isdigit()]
            raise PeerError(_missing_line(address, n, joined, timeout_s))
        # Not our coordinator (or it went away mid-answer): try again until the deadline.
        time.sleep(RETRY_S)


def _answer(conn: socket.socket, deadline: float) -> list[str]:
    """Process 0's answer, waited for in short slices so a signal is noticed."""
    while True:
        _interrupted()
        conn.settimeout(RETRY_S)
        try:
            return conn.recv(4096).decode(errors="replace").split()
        except (TimeoutError, socket.timeout):
            if time.monotonic() > deadline + 5.0:
                return []
