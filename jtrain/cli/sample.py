"""`jtrain sample RUN --prompt TEXT [--prompt TEXT ...]`: its flags and its main; what it
does is jtrain.engine.sample. Each continuation goes to stdout (the prompt, then the new
text), one summary line to stderr."""

from __future__ import annotations

import sys
import time

from absl import flags
from absl import logging as absl_logging

from jtrain.errors import UsageError

PROG = "python -m jtrain sample"
DESCRIPTION = "Continue prompts with a trained language model (a KV-cached decoder)."


def define_flags(fv, argv=None) -> None:
    flags.DEFINE_multi_string("prompt", None, "Text to continue (repeat for a batch).",
                              flag_values=fv)
    flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate per prompt, at most "
                         "(fewer when the model's context fills).", flag_values=fv)
    flags.DEFINE_float("temperature", 0.0, "0: greedy (argmax); above 0: sample from the "
                       "softmax of logits / temperature.", flag_values=fv)
    flags.DEFINE_integer("top_k", 0, "Sample among the k likeliest tokens (0: all).",
                         flag_values=fv)
    flags.DEFINE_float("top_p", 1.0, "Sample among the likeliest tokens whose probabilities "
                       "reach p (1: all).", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "Sampling seed: the same seed, prompts and flags give "
                         "the same text.", flag_values=fv)
    flags.DEFINE_multi_string("stop", None, "Stop a prompt's continuation at this string "
                              "(left out of the output; repeatable).", flag_values=fv)
    flags.DEFINE_string("step", None, "Checkpoint step: N, latest (default) or best (by "
                        "checkpoint.monitor in metrics.jsonl).", flag_values=fv)


def main(fv, args, argv=None) -> int:
    if len(args) != 1:
        raise UsageError("usage: jtrain sample RUN --prompt TEXT [--prompt TEXT ...]")
    if not fv.prompt:
        raise UsageError("--prompt", "required: the text to continue")
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every read at INFO
    from jtrain.checkpoint import store
    from jtrain.engine.sample import sample

    start = time.perf_counter()
    with store.local_copy(args[0]) as run:  # a bucket's run: a staging copy
        out = sample(run, fv.prompt, max_new_tokens=fv.max_new_tokens,
                     temperature=fv.temperature, top_k=fv.top_k, top_p=fv.top_p,
                     seed=fv.seed, stop=fv.stop or (), step=fv.step)
    seconds = time.perf_counter() - start
    for i, (prompt, s) in enumerate(zip(fv.prompt, out, strict=True)):
        sys.stdout.write(("\n" if i else "") + prompt + s.text + "\n")
    sys.stdout.flush()
    tokens = sum(len(s.tokens) for s in out)
    sys.stderr.write(f"jtrain: sample: {len(out)} prompt(s), {tokens} tokens in "
                     f"{seconds:.1f} s (compilation included); finish: "
                     f"{', '.join(s.finish for s in out)}\n")
    return 0
