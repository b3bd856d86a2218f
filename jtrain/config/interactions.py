"""The feature-interaction table: jtrain's features, the config keys and settings that
turn each on, and for every pair of features whether it works or is refused (one line
before the first step). Plain data: a new feature adds a row to FEATURES and, where a
pair does not work, an entry to REFUSED. `cases()` is the pairwise covering array the
suite trains (tests/engine/test_interactions.py), `markdown()` the page
docs/guide/feature-interactions.md.

Features of one factor are alternatives (a run has one update, one precision, one device
set-up): pairs inside a factor are not pairs of the table. A factor listed in REQUIRED
has a feature in every case (the first one is the default)."""

from __future__ import annotations

from itertools import combinations
from typing import NamedTuple


class Feature(NamedTuple):
    name: str
    factor: str
    keys: tuple[str, ...]  # the config keys (or the train() argument) it is set by
    settings: dict  # the dotted config values a generated case sets to turn it on
    case: str  # what a generated case trains with it (the tiny model or data it needs)
    page: str  # docs/guide/ page


def _f(name, factor, keys, settings, case, page) -> Feature:
    return Feature(name, factor, tuple(keys), dict(settings), case, page)


FEATURES: tuple[Feature, ...] = (
    _f("built-in update", "update", ["step.factory"], {}, "the model's loss, optax update",
       "concepts.md"),
    _f("own step", "update", ["step.factory"], {}, "a Step wrapping the same Linen model, "
       "plain SGD", "own-step.md"),
    _f("one device", "devices", ["mesh.data"], {}, "in-process, 1 CPU device",
       "sharding.md"),
    _f("eight devices", "devices", ["mesh.data"], {}, "8 fake CPU devices (multidevice)",
       "sharding.md"),
    _f("elastic resume", "devices", ["mesh.data", "mesh.fsdp"], {"mesh.data": 4,
       "mesh.fsdp": 2}, "8 devices: stopped on a 4 x 2 data x fsdp mesh, resumed on 8 x 1 "
       "(multidevice)", "checkpoints.md"),
    _f("resume", "resume", ["workdir"], {}, "every case: stopped midway and resumed",
       "checkpoints.md"),
    _f("model state", "model_state", ["model.factory"], {},
       "the Linen model with a BatchNorm", "user-models.md"),
    _f("grad accumulation", "grad_accum", ["optim.grad_accum_steps"],
       {"optim.grad_accum_steps": 2}, "2 microbatches", "schedules.md"),
    _f("weight EMA", "ema", ["optim.ema.decay"], {"optim.ema.decay": 0.9}, "decay 0.9",
       "ema.md"),
    _f("population", "population", ["population.size"], {"population.size": 2},
       "2 members", "population.md"),
    _f("frozen / lr_mults", "trainable", ["optim.frozen", "optim.lr_mults"],
       {"optim.frozen": ["^head/bias"], "optim.lr_mults": {"^(body|embed)": 0.5}},
       "head bias frozen, body at half the rate", "optimizers.md"),
    _f("LoRA", "lora", ["finetune.lora.rank"], {"finetune.lora.rank": 2}, "rank 2 on the "
       "Dense kernels", "optimizers.md"),
    _f("init_from", "init_from", ["init.path"], {}, "from a 2-step run of the "
       "same config", "checkpoints.md"),
    _f("topology invariant", "invariant", ["determinism.topology_invariant"],
       {"determinism.topology_invariant": True, "determinism.chunks": 8}, "8 chunks",
       "determinism.md"),
    _f("bf16", "precision", ["model.dtype"], {"model.dtype": "bfloat16"}, "bfloat16 "
       "compute", "precision.md"),
    _f("fp16", "precision", ["model.dtype"], {"model.dtype": "float16",
       "model.init_scale": 1.0}, "float16 compute, dynamic loss scale from 1",
       "precision.md"),
    _f("int8", "quant", ["model.quant"], {"model.quant": "int8"}, "int8 weights and "
       "activations in the Dense matmuls (qwix)", "precision.md"),
    _f("drop_last=False", "drop_last", ["data.drop_last"], {"data.drop_last": False},
       "a padded last batch", "data.md"),
    _f("val_fraction", "val_fraction", ["data.val_fraction"], {"data.val_fraction": 0.25},
       "no eval data: a quarter held out", "data.md"),
    _f("eval weights", "eval_weights", ["eval.weights", "optim.ema.decay"],
       {"eval.weights": "both", "optim.ema.decay": 0.9}, "params and the EMA", "ema.md"),
    _f("batch-scope loss", "loss_scope", ["loss.eval_scope"], {"loss.eval_scope": "batch"},
       "a loss of your own, masked rows weighted 0", "evaluation.md"),
    _f("packing", "packing", ["data.packing"], {"data.packing": "concat", "data.seq_len": 8},
       "token documents, the model's embedding", "mixtures.md"),
    _f("token shards", "packing", ["data.name", "data.path"], {"data.name": "tokens",
       "data.seq_len": 8, "data.val_fraction": 0.25}, "token documents written as shards "
       "(jtrain tokenize's format), windows of 8, a quarter held out",
       "language-models.md"),
    _f("mixture", "mixture", ["data.mixture"], {}, "two components (jtrain.data.Mixture)",
       "mixtures.md"),
    _f("early stop / plateau / best-k", "control", ["early_stop.monitor", "plateau.monitor",
       "checkpoint.keep_top_k"], {"early_stop.monitor": "eval/loss", "early_stop.patience": 5,
       "plateau.monitor": "eval/loss", "checkpoint.keep_top_k": 2}, "eval/loss watched",
       "run-control.md"),
    _f("async eval", "async_eval", ["eval.mode"], {"eval.mode": "async"}, "the child "
       "evaluator", "evaluation.md"),
    _f("s3:// workdir", "storage", ["workdir"], {}, "moto's S3 server in-process",
       "object-storage.md"),
    _f("two-tier checkpoints", "tiers", ["checkpoint.local_dir"],
       {"checkpoint.local_every_steps": 1}, "a local tier saved every step",
       "checkpoints.md"),
    _f("debug.faults", "faults", ["debug.faults"], {"debug.faults": "nan@2"}, "a NaN "
       "update skipped at step 2", "run-control.md"),
)

# Factors every case has one feature of (the first listed is the default).
REQUIRED = ("update", "devices", "resume")

# Pairs that do not work: each stops before step 1 with one line naming both features'
# keys. The key of the pair is the two names in FEATURES' order.
REFUSED: dict[tuple[str, str], str] = {
    ("own step", "grad accumulation"): "a step of your own accumulates inside update",
    ("own step", "weight EMA"): "a step of your own keeps its average in its state",
    ("own step", "population"): "a population vmaps the built-in update",
    ("own step", "frozen / lr_mults"): "they shape the built-in optax update",
    ("own step", "LoRA"): "a step of your own wraps its model itself",
    ("own step", "bf16"): "a step of your own casts its model itself",
    ("own step", "fp16"): "a step of your own casts and scales its loss itself",
    ("own step", "eval weights"): "the EMA weights are the built-in update's",
    ("own step", "int8"): "a step of your own calls its model itself",
    ("population", "int8"): "not implemented for a population",
    ("population", "init_from"): "an export holds one member",
    ("population", "topology invariant"): "not implemented for a population",
    ("population", "early stop / plateau / best-k"): "early stopping and the plateau "
                                                     "decide for one run",
    ("population", "async eval"): "the evaluator scores one run",
    ("LoRA", "int8"): "adapters and quantised matmuls are two qwix interceptions of one "
                      "matmul",
    ("mixture", "async eval"): "the evaluator does not score components",
    ("async eval", "s3:// workdir"): "the evaluator follows a local checkpoint folder",
}


# Commands that read a finished run instead of training one, and the sample a run ends
# with: no pairs (they change no run's state); each row says which runs it reads and what
# it refuses in one line.
AFTER_RUN: dict[str, tuple[str, str]] = {
    "`jtrain sample`": (
        "any run the built-in transformer trained (any float precision, device set-up, "
        "resume, EMA, packing or mixture), or a model with the decode interface; works: "
        "mixture of experts (tests/models/test_moe.py), token shards, decoded with the "
        "run's own tokenizer, greedy equal to transformers' generate on the `--format=hf` "
        "export (tests/journeys/test_tokens_journey.py); refused in one line: a "
        "population, LoRA adapters, a step of your own "
        "(tests/journeys/test_sample_journey.py), model.quant (tests/models/test_quant.py), "
        "pipeline stages (tests/models/test_pipeline.py)",
        "language-models.md"),
    "`sample.prompts` (a run's end)": (
        "the final params, greedy, printed after the final eval loss, the state unchanged "
        "(tests/engine/test_train_e2e.py); works: mixture of experts "
        "(tests/models/test_moe.py), token shards with the run's tokenizer "
        "(tests/journeys/test_tokens_journey.py); one line `jtrain: sample: off: ...` "
        "instead: a population, LoRA, a step of your own, model.quant, a model of your own "
        "(tests/engine/test_sample.py), a run of several processes", "language-models.md"),
}


# Options of the built-in transformer and its tuning recipes: the generated cases train a
# small model of their own, so these are not crossed pairwise; each row says what it
# composes with, what it refuses in one line, and the test that checks it.
MODEL_OPTIONS: dict[str, tuple[str, str, str]] = {
    "chat data (SFT)": ("`data.name=\"chat\"`, `data.chat_template`", "packed by "
                        "`data.packing` (none = one conversation per window, concat, "
                        "first_fit) with the loss on assistant tokens; the built-in "
                        "update with LoRA and with a population; a tokenizer file "
                        "(`data.tokenizer`, e.g. token shards' tokenizer.json) instead of "
                        "bytes; refused: a `data.mixture` "
                        "component named `chat` (not a built-in of mixtures); "
                        "tests/data/test_chat.py, tests/journeys/test_instruct_recipes.py",
                        "language-models.md"),
    "DPO (a step of your own)": ("`step.factory=jtrain.recipes.dpo:make`, `init.into="
                                 "\"policy,ref\"`", "bitwise resume (`--verify_resume`), "
                                 "8 devices = 1 to 1e-5, `init.path` from an SFT run; "
                                 "refused as every step of your own: grad accumulation, "
                                 "weight EMA, population, frozen / lr_mults, LoRA, bf16, "
                                 "fp16, int8; tests/journeys/test_instruct_recipes.py, "
                                 "test_own_step_recipes_multidevice.py", "language-models.md"),
    "mixture of experts": ("`model.moe.experts`", "checked with resume (bitwise), an "
                           "8-device mesh (experts split over `fsdp`) and `jtrain sample`; "
                           "refused: LoRA (`finetune.lora.rank`), `model.quant`, `jtrain "
                           "export --format=hf`; tests/models/test_moe.py", "scaling-out.md"),
    "expert axis": ("`mesh.expert`", "works: FSDP (`mesh.fsdp`: the experts split over "
                    "fsdp x expert) and data 2 x expert 2 x fsdp 2 equal one device; "
                    "tensor (the experts' weights gathered over `tensor` inside the "
                    "exchange); resume (bitwise, `--verify_resume`); `jtrain sample` (decodes "
                    "on one device: the call's tokens routed together); refused: LoRA and "
                    "`model.quant` (as any MoE), `jtrain export --format=hf`, a population, "
                    "`determinism.topology_invariant`, a size that does not divide "
                    "`model.moe.experts`; tests/models/test_expert_axis.py, "
                    "tests/journeys/test_expert_axis_journey.py", "scaling-out.md"),
    "delayed FP8 scaling": ("`model.quant_scaling`", "refused with every feature: "
                            "`delayed` is one line before the first step (qwix 0.1.8 "
                            "has no amax history); `current` is `model.quant` as it is; "
                            "tests/journeys/test_expert_axis_journey.py", "precision.md"),
    "context parallelism": ("`mesh.context`", "checked on fake CPU devices: loss and "
                            "gradients of packed documents (segment_ids, positions) equal "
                            "one device's at context 2, 4, 8 and data 2 x fsdp 2 x context "
                            "2; a built-in step equals the unsplit one with `model.moe`; "
                            "`--verify_resume` bitwise and `jtrain sample` (decoding runs "
                            "unsplit) at context 2; refused: a model or step of your own, "
                            "`population.size`, `determinism.topology_invariant`, LoRA "
                            "(`finetune.lora.rank`), `model.quant`, `mesh.expert`, `mesh.stage`; "
                            "tests/models/test_context.py, tests/journeys/"
                            "test_context_journey.py", "scaling-out.md"),
    "pipeline stages": ("`mesh.stage`, `mesh.microbatches`", "the plain model's loss, "
                        "gradients and steps on 1 and 8 devices (with `data` and `fsdp`), "
                        "`--verify_resume` with gradient accumulation and the weight EMA; "
                        "refused: a model of your own, `model.moe.experts`, `model.quant`, "
                        "LoRA, a population, `determinism.topology_invariant`, `jtrain "
                        "sample`, `mesh.context`, `jtrain export --format=hf`; "
                        "tests/models/test_pipeline.py", "scaling-out.md"),
}


# Token shards (data.name=tokens) with what is not a factor of the generated cases, or is
# one of the same factor (packing): each row says works / refused, and the test.
TOKEN_SHARDS: dict[str, tuple[str, str]] = {
    "data.path on s3:// or gs://": ("works: fetched once into WORKDIR/token_shards/, each file "
                                    "hashed as it arrives; with an s3:// workdir the copies "
                                    "stay in each session's staging folder, never uploaded",
                                    "tests/journeys/test_tokens_s3_journey.py"),
    "several processes": ("works: bitwise resume after a SIGKILL mid-shard, 2 processes over "
                          "loopback", "tests/multihost/test_launch_runs.py"),
    "a mesh": ("works: bitwise resume after a SIGKILL mid-shard on 8 devices; the generated "
               "cases cross it with every feature", "tests/multihost/test_tokens_resume.py"),
    "data.packing": ("refused in one line: the windows already run across documents",
                     "tests/data/test_tokens.py"),
    "data.mixture": ("works: two token corpora as components ({'source': 'tokens', 'kwargs': "
                     "{'path': ...}}), bitwise resume", "tests/engine/test_interactions.py"),
}


# eval.lm_tasks (a language model scored on local files at each eval) beside the features
# a language model trains with: works (the test that checks it) or refused before step 1
# in one line. tests/engine/test_lm_tasks.py unless said.
LM_TASKS: dict[str, str] = {
    "one / eight devices": "works: rows sharded on the batch axis, summed on the host in "
                           "float64; equal to a numpy computation on 1 and 8 devices",
    "LoRA": "works: the run's model function, adapters included; equal to numpy",
    "mixture of experts": "works: the logits of its outputs; equal to numpy",
    "int8 / fp8 (model.quant)": "works, close not exact: activations are quantised with "
                                "one scale per tensor, so a batch's padding moves a score "
                                "(4e-4 relative in the test)",
    "weight EMA, eval.weights": "scored for each evaluated weight set as the eval is "
                                "(`eval/ema/TASK/...`); not covered by a test",
    "early stop / plateau / best-k": "works: `eval/TASK/acc`, `acc_norm`, `ppl` are monitors; "
                                     "tests/journeys/test_lm_tasks_journey.py",
    "your own model (model.factory, NNX / Linen)": "works through the same model function "
                                                   "when it maps tokens [B, L] to logits [B, "
                                                   "L, V >= the vocabulary] (tested with the "
                                                   "built-in Linen transformer); any other "
                                                   "is refused in one line",
    "population": "refused: the members would each need their tasks scored apart",
    "async eval": "refused: the evaluator process scores the eval set only (eval.mode=sync)",
    "external evaluator": "refused with it (eval.async_evaluator=external is async eval); "
                          "`jtrain evaluate` scores the eval set, not the tasks",
    "own step": "refused: a step of your own calls its model itself",
    "lm-eval (jtrain.engine.lm_eval)": "the same scores after the run: its loglikelihoods equal "
                                "the metric's numpy computation",
}


def feature(name: str) -> Feature:
    return next(f for f in FEATURES if f.name == name)


def _key(a: str, b: str) -> tuple[str, str]:
    order = [f.name for f in FEATURES]
    return (a, b) if order.index(a) < order.index(b) else (b, a)


def refused(a: str, b: str) -> str | None:
    """The reason the pair is refused, None when it works."""
    return REFUSED.get(_key(a, b))


def pairs() -> list[tuple[str, str]]:
    """Every pair of the table: two features of different factors, in FEATURES' order."""
    return [(a.name, b.name) for a, b in combinations(FEATURES, 2) if a.factor != b.factor]


def works_pairs() -> list[tuple[str, str]]:
    return [p for p in pairs() if p not in REFUSED]


def _factors() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in FEATURES:
        out.setdefault(f.factor, []).append(f.name)
    return out


def cases(avoid=()) -> list[tuple[str, ...]]:
    """A covering array: cases (sets of features, one per factor at most) such that every
    works-pair is in some case and no case holds a refused pair or a pair of `avoid`
    (those are left uncovered, as are pairs a required factor rules out with them).
    Greedy and deterministic:
    each case starts from the first uncovered pair, then takes, factor by factor, the
    feature covering the most uncovered pairs with what it has (none when nothing gains,
    unless the factor is required)."""
    factors = _factors()
    avoid = {_key(a, b) for a, b in avoid}
    todo = set(works_pairs()) - avoid

    def clash(a: str, b: str) -> bool:
        return refused(a, b) is not None or _key(a, b) in avoid

    out: list[tuple[str, ...]] = []
    while todo:
        first = min(todo, key=pairs().index)
        chosen, feasible = list(first), True
        for factor, names in factors.items():
            if any(feature(c).factor == factor for c in chosen):
                continue
            fits = [n for n in names if not any(clash(n, c) for c in chosen)]
            gains = [(sum(_key(n, c) in todo for c in chosen), -i) for i, n in enumerate(fits)]
            best = max(range(len(fits)), key=lambda i: gains[i], default=None)
            if best is not None and (gains[best][0] > 0 or factor in REQUIRED):
                chosen.append(fits[best])
            feasible = feasible and (best is not None or factor not in REQUIRED)
        if not feasible:  # a required factor has no feature that goes with the pair
            todo.discard(first)
            continue
        case = tuple(f.name for f in FEATURES if f.name in chosen)
        todo -= {_key(a, b) for a, b in combinations(case, 2)}
        out.append(case)
    return out


def markdown() -> str:
    """docs/guide/feature-interactions.md, written from the table."""
    works = works_pairs()
    lines = [
        "# Feature interactions",
        "",
        "<!-- generated from jtrain/config/interactions.py: python -m "
        "jtrain.config.interactions > docs/guide/feature-interactions.md -->",
        "",
        "Every pair of jtrain's features is decided: it either *works* (a generated test "
        "trains it against an oracle: bitwise resume, the eval of the saved state, the "
        "same bits on 1 and 8 devices where promised) or is *refused* before the first "
        "step with one line naming both keys. Features of one row group (one update, one "
        "precision, one device set-up) are alternatives, not pairs.",
        "",
        f"{len(FEATURES)} features, {len(pairs())} pairs: {len(works)} work, "
        f"{len(REFUSED)} are refused; {len(cases())} generated cases cover every working "
        "pair.",
        "",
        "## Features",
        "",
        "| feature | keys | what the tests train | guide |",
        "|---|---|---|---|",
    ]
    for f in FEATURES:
        keys = ", ".join(f"`{k}`" for k in f.keys)
        lines.append(f"| {f.name} | {keys} | {f.case} | [{f.page}]({f.page}) |")
    lines += ["", "## Refused pairs", "", "| feature | feature | why |", "|---|---|---|"]
    for (a, b), why in REFUSED.items():
        lines.append(f"| {a} | {b} | {why} |")
    lines += ["", "## Commands on a finished run, and a run's end", "",
              "| command | reads | guide |",
              "|---|---|---|"]
    for command, (reads, page) in AFTER_RUN.items():
        lines.append(f"| `{command}` | {reads} | [{page}]({page}) |")
    lines += ["", "## Options of the built-in transformer and its tuning recipes", "",
              "| option | keys | composes | guide |", "|---|---|---|---|"]
    for option, (keys, composes, page) in MODEL_OPTIONS.items():
        lines.append(f"| {option} | {keys} | {composes} | [{page}]({page}) |")
    lines += ["", "## Token shards", "", "| with | verdict | test |", "|---|---|---|"]
    for other, (verdict, test) in TOKEN_SHARDS.items():
        lines.append(f"| {other} | {verdict} | {test} |")
    lines += ["", "## Language-model eval tasks (eval.lm_tasks)", "",
              "| with | decided |", "|---|---|"]
    lines += [f"| {feature} | {decided} |" for feature, decided in LM_TASKS.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # > docs/guide/feature-interactions.md
    import sys

    sys.stdout.write(markdown())
