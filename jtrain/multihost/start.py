"""`jax.distributed` start-up for `python -m jtrain.main`, with the failures in one line.

    start(raw_config, coordinator_address, num_processes, process_id, auto=False)

1. `auto`: the coordinator, process count and id come from the cluster (SLURM, Cloud
   TPU) through JAX's own detection; outside one: one line, exit 2.
2. The roll call (rollcall.py) on the coordinator's port: a busy port or a peer that
   does not come within `distributed.init_timeout_s` -> one line, exit 5.
3. `jax.distributed.initialize` with that init timeout, and JAX's heartbeat timeout at
   twice `distributed.heartbeat_timeout_s` plus a margin, so that jtrain's own peer
   monitor (heartbeat.py, at heartbeat_timeout_s) reports a dead peer before JAX aborts.
"""

from __future__ import annotations

import os

from jtrain import internals
from jtrain.config.schema import SCHEMA
from jtrain.errors import ConfigError, UsageError
from jtrain.multihost import heartbeat, rollcall

JAX_HEARTBEAT_MARGIN_S = 10


def timeouts(raw_config) -> tuple[float, float]:
    """(init_timeout_s, heartbeat_timeout_s) from the raw config (validated here: this
    runs before the config is resolved, since the runtime starts first)."""
    section = {}
    try:
        section = dict(raw_config.get("distributed", {}) or {})
    except (AttributeError, TypeError):
        pass
    out = []
    for key in ("init_timeout_s", "heartbeat_timeout_s"):
        field = SCHEMA["distributed"][key]
        value = section.get(key, field.default)
        lo, hi = field.check
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not lo <= value <= (hi if hi is not None else float("inf")):
            raise ConfigError(f"distributed.{key}", f"must be a number of seconds in "
                              f"[{lo:g}, {'inf' if hi is None else format(hi, 'g')}], "
                              f"got {value!r}")
        out.append(float(value))
    return out[0], out[1]


def _detect(init_timeout: float):
    """(coordinator, num_processes, process_id) from the cluster JAX detects."""
    detect = internals.cluster_detector()
    try:
        address, n, pid = detect(init_timeout)
    except Exception as e:  # noqa: BLE001 - a detector that fails part-way
        raise UsageError(f"--distributed=auto: cluster detection failed: {e}") from None
    if address is None or n is None or pid is None:
        raise UsageError("--distributed=auto: no SLURM job or Cloud TPU slice found here; "
                         "use launch/local.sh, or pass --coordinator_address, "
                         "--num_processes and --process_id")
    return address, int(n), int(pid)


def start(raw_config, coordinator_address, num_processes: int, process_id: int,
          auto: bool = False) -> None:
    init_timeout, silent_after = timeouts(raw_config)
    if auto:
        coordinator_address, num_processes, process_id = _detect(init_timeout)
    elif num_processes <= 1:
        return
    if not coordinator_address:
        raise ConfigError("--coordinator_address", "required when --num_processes > 1")
    if not 0 <= process_id < num_processes:
        raise ConfigError("--process_id", f"must be in [0, {num_processes}), "
                          f"got {process_id}")
    if num_processes <= 1:
        return
    rollcall.gather(coordinator_address, num_processes, process_id, init_timeout)
    import jax

    # JAX's coordination service on process 0 listens where the roll call did: the
    # coordinator's interface, not every interface (JAX_COORDINATOR_BIND_ADDRESS wins).
    bind = (rollcall.local_bind_address(coordinator_address)
            if process_id == 0 and not os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") else None)
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes,
        process_id=process_id, initialization_timeout=int(init_timeout) + 1,
        heartbeat_timeout_seconds=int(2 * silent_after) + JAX_HEARTBEAT_MARGIN_S,
        coordinator_bind_address=bind)
    heartbeat.PeerMonitor(internals.distributed_client(), process_id, num_processes,
                          silent_after).start()
