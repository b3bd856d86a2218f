"""Benchmarks of the jtrain engine: `python -m jtrain.bench NAME` (see `cli`).

    cli          the command: argument parsing, dispatch, the overhead report
    overhead     the real training loop vs a hand-written jax.jit loop
    data         jtrain's data pipeline vs torch's DataLoader
    checkpoint   what async checkpointing costs the loop
    peers        jtrain vs plain PyTorch vs Lightning on the same work (whole processes)
    peer_torch   the PyTorch and Lightning side of `peers`, run as a script
"""

from jtrain.bench.cli import main

__all__ = ["main"]
