"""Every metric name a run writes (metrics.jsonl, TensorBoard, MLflow / W&B, summary.json),
in one list: `METRICS`. The writers' names are checked against it by the suite, and
docs/reference/metrics.md is generated from it (`python -m jtrain.reference`).

A name is `<namespace>/<what>`; a part in angle brackets stands for a family of names:

  <term>   a named term of the loss (`loss.terms`, or the dict a user loss returns)
  <k>      eval.top_k
  <i>      a class index (per-class scores, a few classes only)
  <phase>  a start-up phase (jtrain.observe.startup.PHASES, and "other")
  <metric> any train/* or eval/* name above, less its namespace (a population's member)
  <m>      a population member's index (population.size > 1)
  <component>  a component of data.mixture (its own eval set), <metric> any eval/ name
"""

from __future__ import annotations

import re

# name -> (where it is written, what it is)
METRICS: dict[str, tuple[str, str]] = {
    "train/loss": ("log steps", "the log step's own batch: the token-weighted mean loss"),
    "train/loss_window": ("log steps", "mean loss over the log window's applied steps (what "
                          "the progress line shows)"),
    "train/grad_norm": ("log steps", "global norm of the gradient (before clipping)"),
    "train/lr": ("log steps", "learning rate of the step (schedule x ReduceLROnPlateau "
                 "factor)"),
    "train/skipped_steps": ("log steps", "updates skipped so far (non-finite loss or "
                            "gradient, invalid rows): skipped.jsonl lists them"),
    "train/loss_scale": ("log steps", "fp16 dynamic loss scale (precision float16 only)"),
    "train/<term>": ("log steps", "a named loss term's token-weighted mean"),
    "train/moe_aux_loss": ("log steps (model.moe.experts > 0)", "the MoE blocks' mean "
                           "load-balancing loss, E * sum(routed fraction * mean router "
                           "probability): 1 when balanced; train/loss includes "
                           "model.moe.aux_weight times it"),
    "train/moe_dropped_fraction": ("log steps (model.moe.experts > 0)", "token-expert "
                                   "assignments over their expert's capacity, dropped"),
    "train/<metric>/m<m>": ("log steps (population.size > 1)", "member m's train/<metric>; "
                            "the plain name is the mean over the members"),
    **{f"train/{what}": ("log steps (log.train_metrics)", f"the log step's batch: {doc}")
       for what, doc in (
           ("accuracy", "share of correct predictions"),
           ("top_<k>_accuracy", "target among the k highest scores"),
           ("precision_macro", "precision averaged over classes"),
           ("recall_macro", "recall averaged over classes"),
           ("f1_macro", "F1 averaged over classes"),
           ("precision_micro", "precision over all predictions"),
           ("recall_micro", "recall over all predictions"),
           ("f1_micro", "F1 over all predictions"),
           ("precision/<i>", "precision of class i (few classes)"),
           ("recall/<i>", "recall of class i (few classes)"),
           ("f1/<i>", "F1 of class i (few classes)"),
           ("perplexity", "exp of the train loss"),
           ("bits_per_byte", "the train loss in bits per byte"),
           ("mse", "mean squared error"), ("mae", "mean absolute error"),
           ("r2", "coefficient of determination (several outputs: their R² averaged, "
            "as scikit-learn's r2_score)"), ("pearson", "Pearson correlation"))},
    "eval/loss": ("evals", "loss over every eval example, exactly (padding masked)"),
    "eval/<term>": ("evals", "a named loss term over the eval set"),
    "eval/accuracy": ("evals", "classification / sequence: share of correct predictions"),
    "eval/top_<k>_accuracy": ("evals", "target among the k highest scores"),
    "eval/precision_macro": ("evals", "precision averaged over classes"),
    "eval/recall_macro": ("evals", "recall averaged over classes"),
    "eval/f1_macro": ("evals", "F1 averaged over classes"),
    "eval/precision_micro": ("evals", "precision over all predictions"),
    "eval/recall_micro": ("evals", "recall over all predictions"),
    "eval/f1_micro": ("evals", "F1 over all predictions"),
    "eval/precision/<i>": ("evals", "precision of class i (few classes)"),
    "eval/recall/<i>": ("evals", "recall of class i (few classes)"),
    "eval/f1/<i>": ("evals", "F1 of class i (few classes)"),
    "eval/auroc": ("evals", "area under the ROC curve (exact, host side)"),
    "eval/perplexity": ("evals", "exp(eval/loss) for sequence models"),
    "eval/bits_per_byte": ("evals", "byte-level language models: loss in bits per byte"),
    "eval/mse": ("evals", "regression: mean squared error"),
    "eval/mae": ("evals", "regression: mean absolute error"),
    "eval/r2": ("evals", "regression: coefficient of determination; targets [..., k]: "
                "each of the k outputs' R² averaged uniformly (scikit-learn's r2_score "
                "default, multioutput='uniform_average')"),
    "eval/pearson": ("evals", "regression: Pearson correlation"),
    "eval/spearman": ("evals", "regression: Spearman rank correlation (exact, host side)"),
    "eval/<metric>/m<m>": ("evals (population.size > 1)", "member m's eval/<metric>; the "
                           "plain name is the mean over the members"),
    "eval/<component>/<metric>": ("evals", "a data.mixture component's eval set alone "
                                  "(eval/<metric> is all components together)"),
    "eval/<task>/acc": ("evals (eval.lm_tasks)", "a choice task: share of examples whose "
                        "likeliest choice (summed log-likelihood) is the label"),
    "eval/<task>/acc_norm": ("evals (eval.lm_tasks)", "a choice task: the same, each "
                             "choice's log-likelihood divided by its length in characters"),
    "eval/<task>/ppl": ("evals (eval.lm_tasks)", "a perplexity task: exp of the mean "
                        "negative log-likelihood per token of its text"),
    "perf/steps_per_sec": ("log steps, summary", "steps per second since the last log step "
                           "(summary: over the whole run)"),
    "perf/examples_per_sec": ("log steps, summary", "examples per second"),
    "perf/tokens_per_sec": ("log steps", "tokens (loss weight) per second"),
    "perf/data_wait_frac": ("log steps", "share of wall time the loop waited for data"),
    "perf/mfu": ("log steps, summary", "model FLOPs utilisation (needs perf.peak_flops off "
                 "GPU/TPU)"),
    "perf/compile_sec": ("first log step, summary", "the first step's trace, compile and "
                         "dispatch"),
    "perf/time_to_first_step_sec": ("first log step, summary", "from the start to the first "
                                    "step's result"),
    "startup/<phase>_sec": ("first log step, summary", "time to first step, by phase"),
    "compile/count": ("summary", "compilations in the run"),
    "compile/sec": ("summary", "seconds spent compiling"),
    "compile/cache_hits": ("summary", "compilations served by the persistent cache"),
    "compile/cache_misses": ("summary", "compilations the persistent cache did not have"),
    "compile/after_first_step": ("summary", "compilations after the first step"),
    "compile/recompiles": ("summary", "functions compiled again for new shapes or dtypes"),
    "compile/after_first_step_causes": ("summary", "each compilation after the first step: "
                                        "function, kind, shapes, seconds"),
}

_PARTS = {"<term>": r"(?P<term>[A-Za-z0-9_.\-]+)", "<k>": r"\d+", "<i>": r"\d+",
          "<phase>": r"[a-z_]+", "<metric>": r"[A-Za-z0-9_.\-/]+", "<m>": r"\d+",
          "<component>": r"(?P<component>[A-Za-z0-9_.\-]+)",
          "<task>": r"(?P<task>[A-Za-z0-9_.\-]+)"}


def _regex(pattern: str) -> re.Pattern:
    out = re.escape(pattern)
    for part, rx in _PARTS.items():
        out = out.replace(re.escape(part), rx)
    return re.compile(out + r"\Z")


_COMPILED = [(p, _regex(p)) for p in METRICS]


def listed(name: str, terms=(), components=(), tasks=()) -> bool:
    """True when `name` is one of `METRICS`; `<term>` matches only the loss's named
    `terms`, `<component>` only the mixture's `components`, `<task>` only eval.lm_tasks'
    `tasks` (so the check is not vacuous for plain names)."""
    for pattern, rx in _COMPILED:
        m = rx.match(name)
        if m and ("<term>" not in pattern or m.group("term") in terms) and (
                "<component>" not in pattern or m.group("component") in components) and (
                "<task>" not in pattern or m.group("task") in tasks):
            return True
    return False


def markdown() -> str:
    """docs/reference/metrics.md."""
    out = ["# Metric names", "",
           "<!-- Generated by `python -m jtrain.reference --write docs/reference` from "
           "jtrain/metrics/names.py; do not edit. -->", "",
           "Every name a run writes to `metrics.jsonl`, TensorBoard (`WORKDIR/tb`), MLflow / "
           "W&B and `summary.json`. Each record of `metrics.jsonl` also carries `step` and "
           "`time`. A part in angle brackets stands for a family: `<term>` a named loss "
           "term, `<k>` eval.top_k, `<i>` a class index, `<phase>` a start-up phase "
           "(imports, distributed, data, build, state, writers, compile, other), "
           "`<metric>` another train/eval name less its namespace, `<m>` a "
           "population member's index, `<component>` a data.mixture component and `<task>` "
           "an eval.lm_tasks entry.", "",
           "| name | written | what |", "|---|---|---|"]
    for name, (where, what) in METRICS.items():
        out.append(f"| `{name}` | {where} | {what} |")
    return "\n".join(out) + "\n"
