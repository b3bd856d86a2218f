"""`python -m jtrain.bench tokens`: does the token-shard reader keep up with the train
step? Tokens/s the reader delivers against tokens/s the base config's step consumes,
side by side in one process.

`--tokens` byte tokens of text (printable ASCII drawn with seed 0; what is read does not
depend on the values) are written as shards (`jtrain tokenize`'s format, `--shard_tokens`
per shard) into a temporary folder; the base config (configs/base.py, or `--model tiny`)
reads them with data.name=tokens.

reader  the training iterator a run builds (make_train_iterator over the shards'
        windows: the index sampler's shuffle, data.num_workers, batches of numpy),
        `--batches` batches after 2 warm-up batches, timed to the last batch in hand.
step    the same model's jitted train step (jtrain.bench.overhead.HandLoop: forward,
        backward, AdamW) on one batch already on the device, `--steps` steps after 2
        warm-up steps, timed to block_until_ready.

Tokens are the inputs of a batch (batch_size x seq_len). `--rounds` rounds, reader then
step, then the other way round; the ratio reader / step of the medians is the headline:
above 1 the reader is not what a run waits for.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from absl import flags


def define_flags(fv) -> None:
    flags.DEFINE_string("model", "base", "base | tiny (jtrain.bench.overhead's presets)",
                        flag_values=fv)
    flags.DEFINE_integer("tokens", 1 << 22, "tokens written as shards", lower_bound=1 << 12,
                         flag_values=fv)
    flags.DEFINE_integer("shard_tokens", 1 << 20, "tokens per shard", lower_bound=1,
                         flag_values=fv)
    flags.DEFINE_integer("batches", 200, "batches timed per reader round", lower_bound=1,
                         flag_values=fv)
    flags.DEFINE_integer("steps", 10, "steps timed per step round", lower_bound=1,
                         flag_values=fv)
    flags.DEFINE_integer("rounds", 3, "rounds (reader and step each once)", lower_bound=1,
                         flag_values=fv)
    flags.DEFINE_string("out", None, "write the results as JSON to this file", flag_values=fv)


def _shards(folder: str, n: int, per_shard: int) -> None:
    import numpy as np

    from jtrain.data import tokenizer, tokens

    text = np.random.default_rng(0).integers(32, 127, n, dtype=np.uint8).tobytes().decode()
    tokens.write_shards(tokenizer.load("byte"), [text], folder, per_shard)


def run(args) -> dict:
    import jax

    from jtrain import config as config_lib
    from jtrain.bench import machine, overhead

    info = machine.machine()
    with tempfile.TemporaryDirectory(prefix="jtrain-bench-tokens-") as folder:
        _shards(folder, args.tokens, args.shard_tokens)
        cfg = overhead.preset_config(args.model)
        cfg.data.update(name="tokens", path=folder)
        cfg = config_lib.resolve(cfg)
        loop = overhead.HandLoop(cfg)
        per_batch = cfg.data.batch_size * cfg.data.seq_len

        def reader() -> float:
            it = loop.iterator()
            for _ in range(2):
                next(it)
            t0 = time.perf_counter()
            for _ in range(args.batches):
                next(it)
            seconds = time.perf_counter() - t0
            getattr(it, "close", lambda: None)()
            return args.batches * per_batch / seconds

        batch = jax.device_put(next(loop.iterator()))
        state = [loop.init_state()]

        def step() -> float:
            s = state[0]
            for _ in range(2):
                s, loss = loop.step(s, batch)
            jax.block_until_ready(s)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                s, loss = loop.step(s, batch)
            jax.block_until_ready((s, loss))
            state[0] = s
            return args.steps * per_batch / (time.perf_counter() - t0)

        rounds = []
        for r in range(args.rounds):
            row = {}
            for side, fn in ((("reader", reader), ("step", step)) if r % 2 == 0
                             else (("step", step), ("reader", reader))):
                with machine.LoadWatch() as watch:
                    row[side] = fn()
                row[f"{side}_load"] = watch.record
            rounds.append(row)
    med = {s: statistics.median(r[s] for r in rounds) for s in ("reader", "step")}
    return {"machine": info, "model": args.model, "tokens": args.tokens,
            "shard_tokens": args.shard_tokens, "batch_size": cfg.data.batch_size,
            "seq_len": cfg.data.seq_len, "num_workers": cfg.data.num_workers,
            "batches": args.batches, "steps": args.steps, "rounds": rounds, "median": med,
            "reader_vs_step": med["reader"] / med["step"], "load_at_end": os.getloadavg()}


def format_report(res: dict) -> str:
    from jtrain.bench import machine

    lines = [f"token shards: reader vs train step, {res['model']} config (batch "
             f"{res['batch_size']} x seq_len {res['seq_len']}, data.num_workers "
             f"{res['num_workers']}), {res['tokens']} tokens in shards of "
             f"{res['shard_tokens']}, {len(res['rounds'])} rounds",
             machine.header_line(res["machine"])]
    for i, r in enumerate(res["rounds"]):
        lines.append(f"  round {i}: reader {r['reader']:,.0f}"
                     f"{machine.mark(r['reader_load'])} tokens/s, step {r['step']:,.0f}"
                     f"{machine.mark(r['step_load'])} tokens/s")
    m = res["median"]
    lines += [f"  median: reader {m['reader']:,.0f} tokens/s, step {m['step']:,.0f} tokens/s",
              f"  reader / step = {res['reader_vs_step']:.1f}x",
              "  " + machine.loads_line([r[f"{s}_load"] for r in res["rounds"]
                                         for s in ("reader", "step")])]
    return "\n".join(lines)


def main(args) -> int:
    from jtrain.bench import command

    res = run(args)
    print(format_report(res), flush=True)
    return command._write_out(args.out, res)  # noqa: SLF001 - every bench's --out
