"""`python -m jtrain.bench sample`: decode tokens/s of jtrain's sampler with its KV cache,
without it (the whole window recomputed every token) and of transformers' `generate` on
the Hugging Face export of the same parameters.

The model is configs/base.py's transformer (or `--d_model`, `--num_layers`, `--max_len`)
with random parameters: decoding speed does not depend on what was learned. Each side
greedily continues the same `--batch` prompts of `--prompt_len` bytes by exactly
`--new_tokens` tokens (no stop), after one untimed warm-up call that holds compilation;
then `--rounds` rounds, the three sides in turn, each timed with perf_counter around
the whole call (prompt included). Reported: tokens/s per side and round, the medians,
the ratios cache / no cache and jtrain / transformers, whether the three produced the
same tokens, and the machine and load (jtrain.bench.machine).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from absl import flags

SIDES = ("cache", "no_cache", "transformers")


def define_flags(fv) -> None:
    flags.DEFINE_integer("rounds", 3, "rounds (each: cache, no cache, transformers)",
                         flag_values=fv)
    flags.DEFINE_integer("batch", 1, "prompts decoded together", flag_values=fv)
    flags.DEFINE_integer("prompt_len", 16, "bytes per prompt", flag_values=fv)
    flags.DEFINE_integer("new_tokens", 96, "tokens generated per prompt", flag_values=fv)
    flags.DEFINE_integer("d_model", 128, "model width (configs/base.py: 128)", flag_values=fv)
    flags.DEFINE_integer("num_layers", 4, "layers (configs/base.py: 4)", flag_values=fv)
    flags.DEFINE_integer("max_len", 128, "context (configs/base.py: 128)", flag_values=fv)
    flags.DEFINE_string("out", None, "write the results as JSON to this file", flag_values=fv)


def run(args) -> dict:
    import jax
    import numpy as np
    import torch
    import transformers

    from jtrain.bench import machine
    from jtrain.checkpoint import hf_export
    from jtrain.checkpoint.integrity import leaf_path
    from jtrain.engine import sample as sample_lib
    from jtrain.models.transformer import Transformer

    transformers.logging.set_verbosity_error()
    info = machine.machine()
    model = Transformer(vocab_size=256, d_model=args.d_model, num_layers=args.num_layers,
                        num_heads=4, d_ff=4 * args.d_model, max_len=args.max_len,
                        dropout=0.0, tie_embeddings=True)
    prompts = np.random.default_rng(0).integers(32, 127, (args.batch, args.prompt_len))
    rows = [list(map(int, r)) for r in prompts]
    params = model.init(jax.random.key(0), prompts[:, :1])
    leaves = {leaf_path(p): np.asarray(getattr(v, "value", v)) for p, v in
              jax.tree_util.tree_flatten_with_path(params["params"],
                                                   is_leaf=lambda v: hasattr(v, "value"))[0]}
    params = {"params": jax.tree.map(lambda v: getattr(v, "value", v), params["params"],
                                     is_leaf=lambda v: hasattr(v, "value"))}
    decoder = sample_lib.Decoder(model)
    with tempfile.TemporaryDirectory() as tmp:
        hf_export.write(tmp, leaves, {"model": {"name": "transformer",
                                                "max_len": args.max_len}})
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp)
    ids = torch.tensor(prompts)

    def call(side):
        if side == "transformers":
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=args.new_tokens,
                                  min_new_tokens=args.new_tokens, pad_token_id=0)
            return out[:, args.prompt_len:].tolist()
        got = decoder.generate(params, rows, max_new_tokens=args.new_tokens, seed=0,
                               settings=(0.0, 0, 1.0), use_cache=side == "cache")
        return [s.tokens for s in got]

    tokens = {side: call(side) for side in SIDES}  # warm-up: compilation
    rounds = []
    for _ in range(args.rounds):
        row = {}
        for side in SIDES:
            with machine.LoadWatch() as watch:
                t0 = time.perf_counter()
                call(side)
                seconds = time.perf_counter() - t0
            row[side] = args.batch * args.new_tokens / seconds
            row[f"{side}_load"] = watch.record
        rounds.append(row)
    med = {s: statistics.median(r[s] for r in rounds) for s in SIDES}
    return {"machine": info, "batch": args.batch, "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "d_model": args.d_model,
            "num_layers": args.num_layers, "max_len": args.max_len,
            "torch_threads": torch.get_num_threads(), "rounds": rounds, "median": med,
            "cache_vs_no_cache": med["cache"] / med["no_cache"],
            "cache_vs_transformers": med["cache"] / med["transformers"],
            "same_tokens": tokens["cache"] == tokens["no_cache"] == tokens["transformers"],
            "load_at_end": os.getloadavg()}


def format_report(res: dict) -> str:
    from jtrain.bench import machine

    lines = [f"decode tokens/s: d_model {res['d_model']}, {res['num_layers']} layers, batch "
             f"{res['batch']}, prompt {res['prompt_len']} + {res['new_tokens']} new tokens "
             f"(greedy), {len(res['rounds'])} rounds", machine.header_line(res["machine"])]
    for i, r in enumerate(res["rounds"]):
        lines.append(f"  round {i}: " + ", ".join(
            f"{s} {r[s]:.0f}{machine.mark(r[s + '_load'])}" for s in SIDES))
    m = res["median"]
    lines += [f"  median: cache {m['cache']:.0f}, no cache {m['no_cache']:.0f}, "
              f"transformers {m['transformers']:.0f} tokens/s",
              f"  cache / no cache = {res['cache_vs_no_cache']:.2f}x; cache / transformers "
              f"= {res['cache_vs_transformers']:.2f}x; the same tokens on all three sides: "
              f"{res['same_tokens']}",
              "  " + machine.loads_line([r[s + "_load"] for r in res["rounds"]
                                         for s in SIDES])]
    return "\n".join(lines)


def main(args) -> int:
    import json

    if min(args.rounds, args.batch, args.prompt_len, args.new_tokens) < 1 or (
            args.prompt_len + args.new_tokens > args.max_len):
        print("error: --rounds, --batch, --prompt_len, --new_tokens must be >= 1 and "
              "prompt_len + new_tokens <= max_len")
        return 2
    res = run(args)
    print(format_report(res), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return 0
