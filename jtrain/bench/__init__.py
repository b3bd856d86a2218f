"""Benchmarks of the jtrain engine: `python -m jtrain.bench NAME` (the command, its flags
and the overhead report: jtrain/bench/command.py).

    overhead     the real training loop vs a hand-written jax.jit loop
    data         jtrain's data pipeline vs torch's DataLoader
    checkpoint   what async checkpointing costs the loop
    console      the progress bar on a terminal (rich) vs plain lines, per update
    scaling      examples/s per device at 1-8 fake devices; first step cold vs warm cache
    peers        jtrain vs plain PyTorch vs Lightning on the same work (whole processes)
    peer_torch   the PyTorch and Lightning side of `peers`, run as a script
    digits       the mlp case's data as numpy arrays (no torch), for both sides
    population   K runs one after another vs one population of K (one compiled step)
    machine      what every benchmark records: machine, commit, date, load; unreliable
    profile      the train step's time op by op (XLA:CPU trace), matmul GFLOP/s, copies
    async_eval   a run with frequent evaluation: no evals, sync, async, side by side
    invariant    determinism.topology_invariant vs default: step time, step memory, 1 and 8
    variants     one config's step as plain / MoE on the expert axis / int8 / fp8 / bf16:
                 time and memory ratios, model FLOPs, MFU (or "unknown peak")
    sample       decode tokens/s: the KV cache vs none vs transformers' generate
    tokens       token shards: tokens/s the reader delivers vs the train step consumes
    context      mesh.context vs the plain model: step time, memory per device
    table        a benchmark's --out JSON as the markdown tables of docs/benchmarks.md
"""



def main(argv=None) -> int:
    """`jtrain bench NAME [flags]` without the process start-up: the exit code."""
    import sys

    from jtrain import cli

    return cli.run_command("bench", sys.argv[1:] if argv is None else argv)


__all__ = ["main"]
