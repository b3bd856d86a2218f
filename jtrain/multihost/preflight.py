"""Checks that every process of a run is running the same thing, through JAX's
key-value store (never a device collective: a missing peer cannot block them past their
timeout).

`run(cfg, config_hash)` at start-up: the same config hash, local device count and jtrain
version on every process, and no loopback coordinator when the processes are on
several hosts (the remote ones would dial themselves). `check_step(step, cfg)`
(`--debug_multihost`): every `distributed.debug_every_steps` steps all processes must
be at that step with the same config hash. A mismatch: one line, exit 5 (PeerError).
`forget()` after a run removes this process's reports, so the next run in the same
processes (the tune worker's next trial) cannot read the previous run's.
"""

from __future__ import annotations

import ipaddress
import json
import socket

from jtrain import internals
from jtrain.errors import PeerError

PREFLIGHT = "jtrain/preflight/"
STEP = "jtrain/step/"


def _exchange(client, key: str, me: int, n: int, value: str, timeout_s: float,
              what: str) -> dict[int, str]:
    client.key_value_set(f"{key}{me}", value, allow_overwrite=True)
    out = {}
    for pid in range(n):
        try:
            out[pid] = client.blocking_key_value_get(f"{key}{pid}",
                                                     max(1, int(timeout_s * 1000)))
        except Exception:  # noqa: BLE001 - DEADLINE_EXCEEDED: it never wrote it
            raise PeerError(f"{what}: process {pid} did not report within {timeout_s:g} s "
                            "(distributed.heartbeat_timeout_s)") from None
    return out


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _version() -> str:
    """jtrain's installed version (as control.record reads it; not the package root,
    which this floor does not import)."""
    import importlib.metadata as md

    try:
        return md.version("jtrain")
    except md.PackageNotFoundError:  # run from a source tree without an install
        return "unknown"


def run(cfg, config_hash: str) -> None:
    import jax

    client = internals.distributed_client() if jax.process_count() > 1 else None
    if client is None:
        return
    me, n = jax.process_index(), jax.process_count()
    mine = {"config_hash": config_hash, "local_devices": jax.local_device_count(),
            "jtrain_version": _version(), "host": socket.gethostname()}
    reports = {pid: json.loads(v) for pid, v in _exchange(
        client, PREFLIGHT, me, n, json.dumps(mine), cfg.distributed.heartbeat_timeout_s,
        "preflight").items()}
    for field in ("config_hash", "local_devices", "jtrain_version"):
        for pid in range(1, n):
            if reports[pid][field] != reports[0][field]:
                raise PeerError(f"preflight: process {pid} has {field} "
                                f"{reports[pid][field]}, process 0 has {reports[0][field]}; "
                                "every process must run the same config and jtrain on the "
                                "same number of devices")
    address = internals.coordinator_address()
    hosts = {r["host"] for r in reports.values()}
    if len(hosts) > 1 and _is_loopback(address.rpartition(":")[0].strip("[]")):
        raise PeerError(f"preflight: the coordinator address {address} is a loopback "
                        f"address but the processes run on {len(hosts)} hosts; use "
                        "process 0's network address")


def check_step(step: int, cfg, config_hash: str) -> None:
    """--debug_multihost: all processes at `step` with the same config hash."""
    import jax

    client = internals.distributed_client() if jax.process_count() > 1 else None
    if client is None:
        return
    me, n = jax.process_index(), jax.process_count()
    reports = _exchange(client, f"{STEP}{step}/", me, n, config_hash,
                        cfg.distributed.heartbeat_timeout_s, f"--debug_multihost at step {step}")
    for pid, value in reports.items():
        if value != config_hash:
            raise PeerError(f"--debug_multihost at step {step}: process {pid} has config "
                            f"hash {value[:12]}, process {me} has {config_hash[:12]}")


def forget() -> None:
    """Removes this process's reports (start-up and --debug_multihost steps). Call it
    once the run is over on every process (each has read the others' reports)."""
    import jax

    client = internals.distributed_client() if jax.process_count() > 1 else None
    if client is None:
        return
    me = jax.process_index()
    mine = [f"{PREFLIGHT}{me}"] + [key for key, _ in client.key_value_dir_get(STEP)
                                   if key.rsplit("/", 1)[-1] == str(me)]
    for key in mine:
        client.key_value_delete(key)
