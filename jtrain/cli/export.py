"""`python -m jtrain.export --workdir=WORKDIR --out=DIR [--step=N|latest|best]
[--dtype=bfloat16] [--merge_lora] [--weights=ema] [--format=hf]` (or WORKDIR as the one
positional argument): the export command; what it writes is jtrain.checkpoint.export's
(--format=hf: jtrain.checkpoint.hf_export's)."""

from __future__ import annotations

import os

from absl import flags

from jtrain.checkpoint import export as export_lib
from jtrain.checkpoint import hf_export  # imports transformers only when used
from jtrain.checkpoint import store
from jtrain.errors import ExportError, UsageError, classify, first_line

PROG = "python -m jtrain.export"
DESCRIPTION = "Export a checkpoint's parameters (safetensors)."


def define_flags(fv, argv=None) -> None:
    flags.DEFINE_string("workdir", None, "The run to export: its workdir, its checkpoints/ "
                        "dir, or a step dir (the positional WORKDIR works too).",
                        flag_values=fv)
    flags.DEFINE_string("step", None, "Checkpoint step: N, latest (default: the newest "
                        "intact step) or best (by checkpoint.monitor in metrics.jsonl).",
                        flag_values=fv)
    flags.DEFINE_string("out", None, "Output directory (required).", flag_values=fv)
    flags.DEFINE_enum("dtype", None, ["bfloat16", "float16", "float32"],
                      "Cast floating parameters (default: keep the saved dtype).",
                      flag_values=fv)
    flags.DEFINE_bool("merge_lora", False, "Fold LoRA adapters into their weights "
                      "(W + alpha/rank * A @ B): the export loads into the plain model.",
                      flag_values=fv)
    flags.DEFINE_enum("weights", "params", ["params", "ema"], "Weights written: the params "
                      "(default) or the weight EMA in their place (optim.ema.decay > 0).",
                      flag_values=fv)
    flags.DEFINE_integer("member", None, "A population run (population.size > 1): the "
                         "member to export, 0..K-1; written as a plain run's export.",
                         flag_values=fv)
    flags.DEFINE_string("subtree", None, "One named part of the state, written as a plain "
                        "run's export: a step of your own's model, e.g. g (the generator) "
                        "or student; its leaves renamed relative to it.", flag_values=fv)
    flags.DEFINE_enum("format", "jtrain", ["jtrain", "hf"], "jtrain: params.safetensors "
                      "under jtrain's names; hf: a Hugging Face model directory "
                      "(AutoModelForCausalLM.from_pretrained; the built-in transformer).",
                      flag_values=fv)


def main(fv, args, argv=None) -> int:
    if fv.workdir and args and args != [fv.workdir]:
        raise UsageError(f"--workdir={fv.workdir} and the positional {' '.join(args)}: give "
                         "the run once")
    args = args or ([fv.workdir] if fv.workdir else [])
    if len(args) != 1:
        raise UsageError("--workdir: required (a run's workdir, its checkpoints/ dir, or a "
                         f"step dir), got {len(args)} arguments")
    if not fv.out:
        raise UsageError("--out: required (the export directory)")
    try:
        run_export = hf_export.export if fv.format == "hf" else export_lib.export
        # s3:// or gs://: the run read from a staging copy, the export written to one
        # and uploaded when it is whole
        with store.local_copy(args[0]) as run, store.local_copy(fv.out, pull=False) as out:
            record = run_export(run, out, step=fv.step, dtype=fv.dtype,
                                merge_lora=fv.merge_lora, weights=fv.weights,
                                member=fv.member, subtree=fv.subtree)
    except OSError as e:
        known = classify(e, fv.out, flag="--out")  # --out on a full or read-only disk
        if known is not e:
            raise known from None
        raise ExportError(f"{args[0]}: {e.strerror or first_line(e)}") from None
    merged = record.get("merged_lora")
    print(f"jtrain: exported step {record['step']}"
          + (f" of member {fv.member}" if fv.member is not None else "")
          + (" (the weight EMA)" if fv.weights == "ema" else "")
          + (f" (its {fv.subtree})" if fv.subtree else "")
          + (" (the schedule-free average)" if record.get("schedule_free_average") else "")
          + f": {record['num_params']:,} params in "
          f"{record['num_tensors']} tensors ({record['dtype']}) to "
          + (_hf_line(record["hf"], fv.out) if "hf" in record
             else os.path.join(fv.out, export_lib.PARAMS_FILE))
          + (f"; LoRA merged into {merged['merged']} weights (rank {merged['rank']}, alpha "
             f"{merged['alpha']:g})" if merged else ""))
    return 0


def _hf_line(info: dict, out: str) -> str:
    return (f"{out} as {info['architecture']} (Hugging Face"
            + ("; byte-level tokenizer" if info["tokenizer"] == "bytes" else
               f"; tokenizer: {info['tokenizer']}" if info["tokenizer"] else "; no "
               "tokenizer: vocab_size is not 256 bytes and the run kept none") + ")")
