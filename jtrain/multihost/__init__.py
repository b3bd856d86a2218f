"""Several processes, one run: everything jtrain does about its peers.

    start      jax.distributed start-up: cluster auto-detection, the roll call, timeouts
               from `distributed.*` (start(...) is called by jtrain.main)
    rollcall   before JAX's runtime: every process checks in at the coordinator's port,
               so a missing peer or a busy port is one line (exit 5), not a C++ abort
    heartbeat  peer liveness during the run: a heartbeat in JAX's key-value store; a
               dead, stopped or failed peer -> one line on every survivor, exit 5
    preflight  same config hash, device count and jtrain version on every process; a
               multi-node coordinator is not loopback; `--debug_multihost` step checks

Every check goes through the coordination service's key-value store, never through a
device collective, so a peer that is gone cannot block it.
"""

from jtrain.multihost import heartbeat, preflight

__all__ = ["heartbeat", "preflight"]
