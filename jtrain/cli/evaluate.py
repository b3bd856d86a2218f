"""`jtrain evaluate` (= `python -m jtrain.evaluate`, `python -m jtrain evaluate`): its flags and
its main; what it does is jtrain.engine.checkpoint_eval."""

from __future__ import annotations

import os

from absl import flags
from absl import logging as absl_logging

from jtrain.checkpoint import store
from jtrain.engine.checkpoint_eval import evaluate_checkpoint, headline
from jtrain.errors import EvaluateError, JtrainError, UsageError, first_line

PROG = "python -m jtrain.evaluate"
DESCRIPTION = "Evaluate a checkpoint of a jtrain run."


def define_flags(fv, argv=None) -> None:
    flags.DEFINE_string("workdir", None, "The run's directory (required).", flag_values=fv)
    flags.DEFINE_string("step", "latest", "N, latest (default) or best.", flag_values=fv)
    flags.DEFINE_string("data", "eval", "eval (default), train or FILE.npz.", flag_values=fv)
    flags.DEFINE_integer("num_batches", 0, "Eval batches; 0 = every example.", flag_values=fv)
    flags.DEFINE_bool("plots", True, "Write the PNG plots (--noplots: the JSON only).",
                      flag_values=fv)
    flags.DEFINE_bool("no_plots", False, "Same as --noplots.", flag_values=fv)
    flags.DEFINE_enum("weights", None, ["params", "ema", "both"], "Weights evaluated: the "
                      "params, the weight EMA (eval/ema/...) or both; default: the run's "
                      "eval.weights.", flag_values=fv)
    flags.DEFINE_bool("follow", False, "Follow the run: evaluate each new finished "
                      "checkpoint once (WORKDIR/evals/<step>.json; a run not in "
                      "eval.mode=async also gets the metrics in metrics.jsonl with their "
                      "step) until its summary.json says it finished. The workdir may be "
                      "given as the argument: --follow WORKDIR.", flag_values=fv)


def main(fv, args, argv=None) -> int:
    if fv.follow and len(args) == 1 and not fv.workdir:
        fv.workdir, args = args[0], []
    if args:
        raise UsageError(f"unexpected arguments: {' '.join(args)}")
    if not fv.workdir:
        raise UsageError("--workdir: required (the run's directory)")
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every restore at INFO
    if fv.follow:
        if store.is_remote(fv.workdir):
            raise UsageError("--follow", "needs a local --workdir (it watches the run's "
                             f"checkpoint folder); {fv.workdir} is on an object store")
        return _follow(fv.workdir)
    try:  # a bucket's run (s3://, gs://): read from a staging copy, the report uploaded
        with store.local_copy(fv.workdir, write_back=True) as workdir:
            report = evaluate_checkpoint(workdir, step=fv.step, data=fv.data,
                                         num_batches=fv.num_batches,
                                         plots=fv.plots and not fv.no_plots,
                                         weights=fv.weights)
    except (FileNotFoundError, ValueError) as e:
        if isinstance(e, JtrainError):
            raise
        raise EvaluateError(first_line(e)) from None
    print(f"jtrain: eval of step {report['step']} on {report['data']} "
          f"({report['num_examples']:,} examples): {headline(report['metrics'])}")
    shown = fv.workdir if store.is_remote(fv.workdir) else os.path.abspath(fv.workdir)
    print(f"jtrain: wrote {', '.join(report.get('files', []))} in {shown}")
    return 0


def _follow(workdir: str) -> int:
    from jtrain.engine import async_eval

    try:
        steps = async_eval.follow(workdir, say=lambda line: print(line, flush=True))
    except (FileNotFoundError, ValueError) as e:
        if isinstance(e, JtrainError):
            raise
        raise EvaluateError(first_line(e)) from None
    print(f"jtrain: follow: the run finished; evaluated {len(steps)} checkpoints "
          f"(WORKDIR/evals) in {os.path.abspath(workdir)}", flush=True)
    return 0
