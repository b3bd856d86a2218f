"""The schema: every config key once, with its type, default, allowed range or choices,
a one-line description and whether it may change when a run resumes. The only place a
default lives. `jtrain.config` resolves and validates configs against it.
"""

from __future__ import annotations

from typing import Any

from jtrain.config.fields import (ACTIVATIONS, DTYPES, INF, INT_MAX, METRIC_NAMES,  # noqa: F401
                                  OPTIMIZER_CHOICES, OPTIMIZERS, SCHEDULE_FREE, SCHEDULES,
                                  SPACE_KINDS, WRITERS, F, Field, _resume_safe)
from jtrain.config.schema_control import CONTROL_SECTIONS
from jtrain.config.schema_population import POPULATION_SECTIONS

SCHEMA: dict[str, Any] = {
    "seed": F(int, 0, (0, INT_MAX), "seed of parameter init, dropout and data order"),
    "total_steps": F(int, 1000, (1, INF), "optimizer updates in the run"),
    "max_steps_in_flight": F(int, 8, (1, 16), "steps dispatched ahead of the host "
                             "(CPU collectives deadlock past ~32)", resume=True),
    "model": {
        "name": F(str, "transformer", None, "built-in family (MODEL_FAMILIES); a model "
                  "passed to jtrain.train replaces it"),
        "dtype": F(str, "auto", DTYPES, "compute dtype; auto = bfloat16 on GPU/TPU, "
                   "float32 on CPU"),
        "param_dtype": F(str, "float32", ("float32", "bfloat16"), "dtype parameters are "
                         "stored in"),
        "loss_scale": F(str, "auto", ("auto", "dynamic", "none"), "fp16 loss scaling; auto "
                        "= dynamic for float16 compute"),
        "init_scale": F(float, 2.0**15, (1.0, 2.0**24), "initial dynamic loss scale"),
        "keep_fp32": F("strs", ("norm",), None, "your model: regexes (case-insensitive) of "
                       "parameter paths not cast to the compute dtype"),
        "quant": F(str, "none", ("none", "int8", "fp8"), "8-bit quantised training "
                   "through qwix: int8 = int8 weights (per channel) and activations in the "
                   "forward matmuls; fp8 = float8_e4m3fn forward, float8_e5m2 gradients"),
        "quant_scaling": F(str, "current", ("current", "delayed"), "model.quant's scales: "
                           "current = from each batch's absmax; delayed (an amax history "
                           "in the train state) is refused: qwix 0.1.8 has none"),
        # + the fields of MODEL_FAMILIES[model.name]
    },
    "optim": {
        "name": F(str, "adamw", OPTIMIZER_CHOICES, "optimizer: a built-in name, or any "
                  "optax / optax.contrib function ('optax.lion', 'optax.contrib.ademamix') "
                  "with optim.kwargs"),
        "kwargs": F("dict", {}, None, "the optimizer's own arguments: a built-in name's "
                    "(below, their defaults filled in) or an optax.* function's "
                    "(learning_rate comes from optim.lr / optim.schedule, weight_decay "
                    "from optim.weight_decay)"),
        "lr": F(float, 1e-3, (0.0, 10.0), "peak learning rate"),
        "schedule": F(str, "warmup_cosine", SCHEDULES, "learning-rate schedule after a "
                      "linear warmup"),
        "warmup_steps": F(int, 0, (0, INF), "linear warmup from 0 to lr"),
        "decay_steps": F(int, 0, (0, INF), "step where decays end; 0 = total_steps"),
        "end_lr_factor": F(float, 0.0, (0.0, 1.0), "final lr as a fraction of lr"),
        "weight_decay": F(float, 0.0, (0.0, 10.0), "decoupled weight decay (masked off "
                          "biases, norms and, by default, embeddings)"),
        "decay_embeddings": F(bool, False, None, "apply weight decay to embedding tables"),
        "clip_norm": F(float, 0.0, (0.0, INF), "global-norm gradient clipping; 0 = off"),
        "grad_accum_steps": F(int, 1, (1, 4096), "microbatches per update (inside the step)"),
        "b1": F(float, 0.9, (0.0, 1.0), "adam / adamw / lion / prodigy beta1 and muon's "
                "adam fallback, in [0, 1); schedule_free_*: the interpolation, in (0, 1)"),
        "b2": F(float, 0.999, (0.0, 1.0), "adam / adamw / lion / prodigy / "
                "schedule_free_adamw beta2 and muon's adam fallback, in [0, 1)"),
        "eps": F(float, 1e-8, (0.0, 1.0), "adam-family epsilon (muon, prodigy, "
                 "schedule_free_adamw too)"),
        "trainable": F("strs", (), None, "regexes of parameter paths that train; () = all "
                       "(the rest are frozen: no update, no optimizer state)"),
        "frozen": F("strs", (), None, "regexes of parameter paths that never train"),
        "lr_mults": F("dict", {}, None, "{regex: factor}: learning-rate multiplier per "
                      "parameter path, first match wins"),
        "ema": {  # jtrain/state.py: the average lives in the state, exact under resume
            "decay": F(float, 0.0, (0.0, 1.0), "weight EMA decay d in [0, 1) (ema <- d * "
                       "ema + (1 - d) * params after each update); 0 = off"),
            "warmup": F(str, "none", ("none", "standard"), "EMA decay warmup: none = d "
                        "from the first update; standard = min(d, (1 + t) / (10 + t)), t "
                        "= updates applied before"),
        },
    },
    "data": {
        "name": F(str, "pystdlib", None, "built-in dataset (checked by jtrain.data): "
                  "pystdlib (bytes), tokens (data.path) or chat (data.path: JSONL "
                  "conversations, jtrain.data.chat)"),
        "batch_size": F(int, 32, (1, INF), "global batch, over all processes"),
        "seq_len": F(int, 128, (1, INF), "window length of the built-in text data"),
        "path": F(str, "", None, "data.name=tokens: the folder of token shards that "
                  "`jtrain tokenize --out` wrote; data.name=chat: the JSONL file"),
        "tokenizer": F(str, "", None, "data.name=tokens: the shards' tokenizer, filled in "
                       "from data.path's index.json ('byte' or 'FILE (sha256 ...)', the "
                       "file copied into the workdir); set, it must match; "
                       "data.name=chat: the tokenizer file ('' = bytes)"),
        "chat_template": F(str, "<|{role}|>\n{content}<|end|>\n", None, "data.name=chat: "
                           "each message as text, {role} then {content} substituted "
                           "(never executed); the loss falls on assistant content + end"),
        "val_fraction": F(float, 0.05, (0.0, 0.9), "held out for eval when there is no "
                          "eval data"),
        "split_seed": F(int, 0, (0, INT_MAX), "seed of that split (not the run's seed)"),
        "shuffle": F(bool, True, None, "reshuffle per epoch from (seed, epoch)"),
        "drop_last": F(bool, True, None, "False: the last batch is padded, with a mask"),
        "num_workers": F(int, 0, (0, 256), "grain worker processes (spawned)", resume=True),
        "num_threads": F(int, 0, (0, 256), "reader threads per process / worker, for "
                         "I/O-bound datasets; 0 = read in the prefetch thread", resume=True),
        "prefetch": F(int, 2, (0, 1024), "batches read ahead on the host (per worker)",
                      resume=True),
        "device_prefetch": F(int, -1, (-1, 16), "batches put on devices ahead; 0 off, "
                             "-1 auto (2 on GPU/TPU, 0 on CPU)", resume=True),
        "source": F(str, "", None, "'package.module:function' called with kwargs, returning "
                    "the data or {'train': ..., 'eval': ...}; overrides name"),
        "kwargs": F("dict", {}, None, "keyword arguments of data.source"),
        "transform": F(str, "", None, "'package.module:fn', fn(item, rng) on train items"),
        "valid_fn": F(str, "", None, "'package.module:fn', fn(batch) -> bool scalar, traced "
                      "in the step: False skips the batch's update (jtrain.control)"),
        "model_inputs": F("strs", (), None, "fields of a dict batch the model is called "
                          "with (one: that array; several: a dict of them); () = "
                          "batch['inputs'], or the whole batch when it has no 'inputs' "
                          "(with data.packing and the built-in transformer: inputs, "
                          "segment_ids, positions)"),
        "mixture": F("dict", {}, None, "{name: {'source': 'pkg.mod:fn' or a built-in "
                     "name, 'kwargs': {...}, 'weight': w}}: components sampled by weight "
                     "(jtrain.data.mixture); {} = one dataset"),
        "mixture_schedule": F("dict", {}, None, "{step: {name: weight}}: the mixture's "
                              "weights from that step on (names left out weigh 0)"),
        "packing": F(str, "none", ("none", "pad", "concat", "first_fit"), "token documents "
                     "-> data.seq_len windows with segment_ids and positions: pad = one "
                     "document per window, concat = in order, first_fit = greedy first fit "
                     "in a seeded order (data.split_seed); none = items as they are"),
        "packing_buffer": F(int, 64, (1, 1 << 20), "first_fit: windows kept open at once"),
    },
    "mesh": _resume_safe({
        "data": F(int, -1, (-1, INF), "pure data-parallel axis; -1 = the rest"),
        "fsdp": F(int, 1, (-1, INF), "data-parallel axis sharding params and optimizer state"),
        "expert": F(int, 1, (-1, INF), "expert-parallel axis: model.moe's experts split "
                    "over it, tokens sent to their experts' devices by all-to-all; the "
                    "batch is split over it too (docs/guide/scaling-out.md)"),
        "context": F(int, 1, (-1, INF), "context-parallel axis: the built-in transformer's "
                     "sequences split over it, keys and values gathered for attention "
                     "(docs/guide/scaling-out.md)"),
        "tensor": F(int, 1, (-1, INF), "tensor-parallel axis"),
        "auto_shard": F(bool, True, None, "with mesh fsdp > 1, shard each parameter the "
                        "model did not annotate along its largest dimension divisible by "
                        "the fsdp size (optimizer state and EMA follow); annotated leaves "
                        "keep their annotation. On by default: an unannotated model would "
                        "otherwise be replicated on every device (docs/guide/sharding.md)"),
        "auto_shard_min_bytes": F(int, 4096, (0, INF), "mesh.auto_shard leaves smaller "
                                  "than this stay replicated (a shard's collective costs "
                                  "more than the memory it saves)"),
        "microbatches": F(int, 4, (1, INF), "with mesh.stage > 1: microbatches per "
                          "pipelined forward pass; the idle share of a pass (the bubble) is "
                          "(stage - 1) / (microbatches + stage - 1)"),
    }) | {  # the parameters' layout: not resume-safe
        "stage": F(int, 1, (1, INF), "pipeline stages: the built-in transformer's layers "
                   "split over this axis, run as a GPipe schedule (docs/guide/scaling-out.md)"),
    },
    "eval": _resume_safe({
        "every_steps": F(int, 200, (0, INF), "evaluate every N steps; 0 = only at the end"),
        "num_batches": F(int, 0, (0, INF), "eval batches; 0 = the whole eval set"),
        "batch_size": F(int, 0, (0, INF), "eval global batch; 0 = data.batch_size"),
        "metrics": F("strs", (), METRIC_NAMES, "metrics to compute; () = the task's "
                     "defaults (jtrain.metrics.tasks)"),
        "top_k": F(int, 5, (1, INF), "k of top_k_accuracy"),
        "max_gathered": F(int, 1_000_000, (1, INF), "AUROC / Spearman keep this many "
                          "examples, exactly"),
        "weights": F(str, "params", ("params", "ema", "both"), "weights evaluated: "
                     "params (eval/...), the weight EMA (eval/ema/...; optim.ema.decay > "
                     "0) or both"),
        "predict_fn": F(str, "", None, "'package.module:fn', fn(outputs, batch) -> "
                        "(predictions, targets[, weights]) that the metrics compare (e.g. a "
                        "negative-binomial mean vs counts); '' = outputs vs batch targets"),
        "lm_tasks": F("dict", {}, None, "a language model scored on local files at each "
                      "eval: {name: {kind: choice | perplexity, path}} -> eval/<name>/acc, "
                      "acc_norm (a JSONL of {context, choices, label}) or eval/<name>/ppl "
                      "(a text file) (docs/guide/language-models.md)"),
    }) | {  # these change what the run decides and when: not resume-safe
        "mode": F(str, "sync", ("sync", "async"), "sync = the loop evaluates and waits; "
                  "async = each evaluation point's checkpoint is evaluated by a separate "
                  "process (jtrain evaluate --follow) while training goes on, and early "
                  "stopping, the plateau and best-k keeping decide at eval.async_lag "
                  "evaluation points later (docs/guide/evaluation.md)"),
        "async_lag": F(int, 1, (1, 1000), "eval.mode=async: the decision at evaluation "
                       "point k uses the eval of point k - async_lag, always; training "
                       "waits only when that eval is not done yet"),
        "async_evaluator": F(str, "child", ("child", "external"), "eval.mode=async: child "
                             "= the train command starts `python -m jtrain.evaluate "
                             "--follow WORKDIR` beside itself and ends it; external = you "
                             "run that command (e.g. on another host that reads the workdir)",
                             resume=True),
    },
    "loss": {  # jtrain/losses/terms.py; a loss_fn passed to jtrain.train replaces fn / terms
        "fn": F(str, "", None, "'package.module:fn', fn(outputs, batch) -> loss, (sum, "
                "weight), or either with a dict of named terms; '' = the default loss"),
        "terms": F("dict", {}, None, "weighted multi-loss: {name: {fn, output, target, "
                   "weights, weight, kwargs}}, each term logged as train/<name>, eval/<name>"),
        "eval_scope": F(str, "auto", ("auto", "example", "batch"), "how eval scores a "
                        "user loss on a padded batch: example = one example at a time "
                        "(exact for any per-example loss), batch = the whole batch, padding "
                        "rows weighted 0 via batch['mask'] (exact for losses that honour "
                        "losses.weights_for; needed for batch-level losses such as a "
                        "correlation); auto = batch for loss.terms, else example",
                        resume=True),
    },
    "step": {  # jtrain.engine.own_step; replaces the built-in update: not resume-safe
        "factory": F(str, "", None, "'package.module:function' returning a step of your "
                     "own (jtrain.step.Step: init, update, evaluate) that replaces the "
                     "built-in update; '' = the built-in update of the model and optimizer"),
        "kwargs": F("dict", {}, None, "keyword arguments of step.factory"),
    },
    "finetune": {  # jtrain.models.lora; changes the model and what trains: not resume-safe
        "lora": {
            "rank": F(int, 0, (0, 4096), "LoRA rank r: adapters A [in, r] and B [r, out] "
                      "beside each targeted matmul weight, which freezes; only adapters "
                      "train; 0 = off (needs qwix: pip install 'jtrain[lora]')"),
            "alpha": F(float, 16.0, (0.0, INF), "LoRA scale: a weight W acts as "
                       "W + alpha/rank * A @ B (python -m jtrain.export --merge_lora)"),
            "targets": F(str, "^(?!.*embed)", None, "regex (re.search) of the parameter "
                         "paths of the matmul weights that get adapters, e.g. 'attn|mlp'; "
                         "default: every weight whose path has no 'embed'"),
        },
    },
    "sample": _resume_safe({  # jtrain.engine.sample.end_of_run; the trained state unchanged
        "prompts": F("strs", (), None, "the run ends with each prompt's greedy continuation "
                     "from the final params, printed beside the eval loss (the built-in "
                     "transformer; one line for other runs); empty = off"),
        "max_new_tokens": F(int, 32, (0, INF), "tokens each continuation has at most (the "
                            "model's context caps it); 0 = off"),
    }),
    "log": _resume_safe({
        "every_steps": F(int, 50, (1, INF), "log train metrics every N steps"),
        "train_metrics": F("strs", (), METRIC_NAMES, "metrics computed in the train "
                           "step from the model outputs, logged as train/<name>: the log "
                           "step's batch, like train/loss (same definitions as eval.metrics;"
                           " docs/guide/sharding.md)"),
        "writers": F("strs", ("jsonl", "tensorboard"), WRITERS, "metric writers (jsonl is "
                     "always on)"),
        "verbosity": F(int, 1, (0, 2), "0 errors + summary, 1 default, 2 debug"),
        "all_hosts": F(bool, False, None, "processes other than 0 print too"),
        "divergence_warning": F(float, 2.0, (0.0, INF), "warn once when a logged train "
                                "loss window exceeds this many times the first one "
                                "(results unchanged); 0 = off"),
        "mlflow_tracking_uri": F(str, "", None, "MLflow tracking URI; '' = WORKDIR/mlflow.db"),
        "mlflow_experiment": F(str, "jtrain", None, "MLflow experiment name"),
        "wandb_project": F(str, "jtrain", None, "W&B project"),
        "wandb_mode": F(str, "offline", ("offline", "online", "disabled"), "W&B mode"),
    }),
    **CONTROL_SECTIONS,
    **POPULATION_SECTIONS,
}

# Built-in model families: their keys under `model.` (jtrain.models.<name> builds them).
MODEL_FAMILIES: dict[str, dict[str, Field]] = {
    "user": {
        "factory": F(str, "", None, "'package.module:function' returning your model "
                     "(Linen, NNX or (init, apply)); jtrain.models.user"),
        "kwargs": F("dict", {}, None, "keyword arguments of model.factory"),
    },
    "transformer": {
        "vocab_size": F(int, 256, (1, INF), "token vocabulary (256: bytes)"),
        "d_model": F(int, 128, (1, INF), "residual width"),
        "num_layers": F(int, 2, (1, INF), "transformer blocks"),
        "num_heads": F(int, 4, (1, INF), "attention heads (d_model / num_heads even)"),
        "d_ff": F(int, 512, (1, INF), "MLP hidden width"),
        "max_len": F(int, 256, (1, INF), "longest sequence (rotary positions)"),
        "dropout": F(float, 0.0, (0.0, 1.0), "dropout rate in [0, 1)"),
        "tie_embeddings": F(bool, True, None, "output projection = embedding table"),
        "attention": F(str, "auto", ("auto", "xla", "cudnn"), "attention kernel: xla = "
                       "written out; cudnn = fused (GPU, 16-bit dtype); auto = cudnn where "
                       "it applies, else xla"),
        "remat": F(str, "none", ("none", "full", "dots_saveable",
                                 "dots_with_no_batch_dims_saveable"),
                   "per-block rematerialisation (jax.checkpoint policy): full = keep "
                   "only block inputs; dots_* = keep matmul outputs; trades compute "
                   "for activation memory, same results"),
        "mlp": F(str, "gelu", ("gelu", "swiglu"), "MLP: gelu = up, GELU (tanh), down; "
                 "swiglu = down(silu(gate) * up), Llama's (docs/guide/huggingface.md)"),
        "moe": {  # jtrain/models/moe.py; docs/guide/scaling-out.md
            "experts": F(int, 0, (0, 4096), "mixture of experts: routed MLPs per MoE "
                         "block; 0 = the dense MLP"),
            "k": F(int, 2, (1, 4096), "experts each token runs through (top-k of the "
                   "router), at most experts"),
            "capacity_factor": F(float, 1.25, (0.0, 1024.0), "an expert takes at most "
                                 "ceil(capacity_factor * tokens * k / experts) tokens; "
                                 "the rest are dropped (the residual passes)"),
            "every": F(int, 1, (1, INF), "every n-th block (counted from the last) is a "
                       "MoE block"),
            "aux_weight": F(float, 0.01, (0.0, 100.0), "weight of the load-balancing "
                            "loss added to the training loss"),
        },
    },
    "mlp": {
        "hidden": F("ints", (64, 64), None, "hidden layer widths"),
        "num_outputs": F(int, 10, (1, INF), "classes (or regression outputs)"),
        "dropout": F(float, 0.0, (0.0, 1.0), "dropout rate in [0, 1)"),
        "activation": F(str, "gelu", None, "activation: " + ", ".join(ACTIVATIONS)),
    },
}


def fields(schema: dict, prefix: str = ""):
    """(dotted key, Field) for every key of a (sub)schema, in declaration order."""
    for key, spec in schema.items():
        if isinstance(spec, dict):
            yield from fields(spec, f"{prefix}{key}.")
        else:
            yield prefix + key, spec


def schema_for(model_name: str) -> dict:
    return {**SCHEMA, "model": {**SCHEMA["model"], **MODEL_FAMILIES[model_name]}}


def resume_safe(key: str) -> bool:
    """May the dotted `key` differ on resume without `checkpoint.allow_changes`? (Not a
    model family's key: it changes the model.)"""
    field = field_of(key)
    return field is not None and field.resume


def field_of(key: str) -> Field | None:
    """The Field of the dotted `key` (None for a model family's key or an unknown one)."""
    node: Any = SCHEMA
    for part in key.split("."):
        if not (isinstance(node, dict) and part in node):
            return None
        node = node[part]
    return node if isinstance(node, Field) else None


def describe() -> list[tuple[str, Field]]:
    """(dotted key, field) for every key, model families as `model.<key> [family]`, a
    built-in optimizer's arguments as `optim.kwargs.<arg> [name]`."""
    out = list(fields(SCHEMA))
    for family, keys in MODEL_FAMILIES.items():
        out += [(f"{k} [{family}]", v) for k, v in fields(keys, "model.")]
    for name, args in OPTIMIZERS.items():
        out += [(f"optim.kwargs.{k} [{name}]", v) for k, v in args.items()]
    return out
