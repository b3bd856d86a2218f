"""The schema: every config key once, with its type, default, allowed range or choices,
a one-line description and whether it may change when a run resumes. The only place a
default lives. `jtrain.config` resolves and validates configs against it.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Field(NamedTuple):
    """One config key. `type`: int, float, bool, str, "strs" / "ints" (tuples), "dict"
    (free-form kwargs), "optfloat" (a number or None = off; an ml_collections float
    placeholder in config files, so `--config.x=0.5` works). `check`: a range (lo, hi) with None for an open end (inclusive),
    a tuple of choices, or None. `resume`: True when the key may differ on resume without
    `checkpoint.allow_changes` (it cannot change the trained state, or, for mesh.*, only
    the float reduction order)."""
    type: Any
    default: Any
    check: Any
    doc: str
    resume: bool = False


INF = None
INT_MAX = 2**31 - 1

# Choices, declared here; their consumers keep a dict per name (tests check they agree).
DTYPES = ("float32", "bfloat16", "float16", "auto")
OPTIMIZERS = ("adamw", "adam", "sgd", "lion", "adafactor", "muon", "schedule_free_adamw",
              "schedule_free_sgd", "prodigy")
SCHEDULES = ("constant", "linear", "cosine", "warmup_cosine", "warmup_linear", "rsqrt")
WRITERS = ("jsonl", "tensorboard", "mlflow", "wandb")
METRIC_NAMES = ("loss", "accuracy", "top_k_accuracy", "precision_recall_f1",
                "confusion_matrix", "auroc", "perplexity", "bits_per_byte",
                "mse", "mae", "r2", "pearson", "spearman")
ACTIVATIONS = ("gelu", "relu", "silu", "tanh")
SPACE_KINDS = ("log_uniform", "uniform", "int", "log_int", "choice")  # tune.space
F = Field


def _resume_safe(section: dict) -> dict:
    return {k: v._replace(resume=True) for k, v in section.items()}


SCHEMA: dict[str, Any] = {
    "seed": F(int, 0, (0, INT_MAX), "seed of parameter init, dropout and data order"),
    "total_steps": F(int, 1000, (1, INF), "optimizer updates in the run"),
    "max_steps_in_flight": F(int, 8, (1, 16), "steps dispatched ahead of the host "
                             "(CPU collectives deadlock past ~32)", resume=True),
    "deterministic": F(bool, False, None, "deterministic GPU ops (XLA flags set before the "
                       "backend starts); CPU is deterministic already", resume=True),
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
        # + the fields of MODEL_FAMILIES[model.name]
    },
    "optim": {
        "name": F(str, "adamw", OPTIMIZERS, "optimizer (jtrain/optim.py)"),
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
        "muon_beta": F(float, 0.95, (0.0, 1.0), "muon: momentum of the 2-D leaves, in [0, 1)"),
        "muon_ns_steps": F(int, 5, (1, 100), "muon: Newton-Schulz iterations"),
        "prodigy_d0": F(float, 1e-6, (1e-12, 1.0), "prodigy: initial step-size estimate D0"),
        "momentum": F(float, 0.9, (0.0, 1.0), "sgd momentum; 0 = plain sgd"),
        "nesterov": F(bool, False, None, "sgd: Nesterov momentum"),
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
        "name": F(str, "pystdlib", None, "built-in dataset (checked by jtrain.data)"),
        "batch_size": F(int, 32, (1, INF), "global batch, over all processes"),
        "seq_len": F(int, 128, (1, INF), "window length of the built-in text data"),
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
                          "batch['inputs'], or the whole batch when it has no 'inputs'"),
    },
    "mesh": _resume_safe({
        "data": F(int, -1, (-1, INF), "pure data-parallel axis; -1 = the rest"),
        "fsdp": F(int, 1, (-1, INF), "data-parallel axis sharding params and optimizer state"),
        "tensor": F(int, 1, (-1, INF), "tensor-parallel axis"),
    }),
    "eval": _resume_safe({
        "every_steps": F(int, 200, (0, INF), "evaluate every N steps; 0 = only at the end"),
        "num_batches": F(int, 0, (0, INF), "eval batches; 0 = the whole eval set"),
        "batch_size": F(int, 0, (0, INF), "eval global batch; 0 = data.batch_size"),
        "metrics": F("strs", (), METRIC_NAMES, "metrics to compute; () = the task's "
                     "defaults (jtrain/metrics/tasks.py)"),
        "top_k": F(int, 5, (1, INF), "k of top_k_accuracy"),
        "max_gathered": F(int, 1_000_000, (1, INF), "AUROC / Spearman keep this many "
                          "examples, exactly"),
        "weights": F(str, "params", ("params", "ema", "both"), "weights evaluated: "
                     "params (eval/...), the weight EMA (eval/ema/...; optim.ema.decay > "
                     "0) or both"),
        "predict_fn": F(str, "", None, "'package.module:fn', fn(outputs, batch) -> "
                        "(predictions, targets[, weights]) that the metrics compare (e.g. a "
                        "negative-binomial mean vs counts); '' = outputs vs batch targets"),
    }),
    "loss": {  # jtrain/loss_terms.py; a loss_fn passed to jtrain.train replaces fn / terms
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
    "finetune": {  # jtrain/models/lora.py; changes the model and what trains: not resume-safe
        "lora": {
            "rank": F(int, 0, (0, 4096), "LoRA rank r: adapters A [in, r] and B [r, out] "
                      "beside each targeted matmul weight, which freezes; only adapters "
                      "train; 0 = off (needs qwix: pip install 'jtrain[lora]')"),
            "alpha": F(float, 16.0, (0.0, INF), "LoRA scale: a weight W acts as "
                       "W + alpha/rank * A @ B (python -m jtrain.export --merge_lora)"),
            "targets": F(str, "^(?!.*embed)", None, "regex (re.search) of module paths "
                         "whose matmul weights get adapters, e.g. 'attn|mlp'; default: "
                         "every module whose path has no 'embed'"),
        },
    },
    "log": _resume_safe({
        "every_steps": F(int, 50, (1, INF), "log train metrics every N steps"),
        "writers": F("strs", ("jsonl", "tensorboard"), WRITERS, "metric writers (jsonl is "
                     "always on)"),
        "verbosity": F(int, 1, (0, 2), "0 errors + summary, 1 default, 2 debug"),
        "all_hosts": F(bool, False, None, "processes other than 0 print too"),
        "mlflow_tracking_uri": F(str, "", None, "MLflow tracking URI; '' = WORKDIR/mlflow.db"),
        "mlflow_experiment": F(str, "jtrain", None, "MLflow experiment name"),
        "wandb_project": F(str, "jtrain", None, "W&B project"),
        "wandb_mode": F(str, "offline", ("offline", "online", "disabled"), "W&B mode"),
    }),
    "compile": _resume_safe({  # jtrain/observe/compiles.py
        "cache_dir": F(str, "auto", None, "persistent XLA compilation cache shared by "
                       "runs and processes; auto = $XDG_CACHE_HOME/jtrain/xla or "
                       "~/.cache/jtrain/xla; '' = off"),
        "cache_max_gb": F(float, 8.0, (0.0, INF), "least-recently used cache entries "
                          "are evicted past this size; 0 = no limit"),
        "precompile": F(bool, True, None, "compile the train step in a background "
                        "thread while the state initialises (its first call reuses it)"),
    }),
    "profile": _resume_safe({
        "start_step": F(int, 0, (0, INF), "first traced step; 0 = no jax.profiler trace"),
        "num_steps": F(int, 5, (1, INF), "steps traced into WORKDIR/profile"),
    }),
    "perf": _resume_safe({
        "peak_flops": F(float, 0.0, (0.0, INF), "peak FLOP/s per device for MFU; 0 = from "
                        "the device kind"),
    }),
    "checkpoint": _resume_safe({  # read by jtrain.checkpoint
        "every_steps": F(int, 500, (0, INF), "save every N steps; 0 = only at the end"),
        "every_seconds": F(float, 0.0, (0.0, INF), "also save every N seconds; 0 = off"),
        "max_to_keep": F(int, 3, (1, INF), "keep the latest K (the latest always stays)"),
        "keep_every_steps": F(int, 0, (0, INF), "also keep steps that are multiples of N"),
        "keep_top_k": F(int, 1, (0, INF), "also keep the k best by monitor"),
        "monitor": F(str, "eval/loss", None, "metric ranking checkpoints"),
        "mode": F(str, "min", ("min", "max"), "whether lower or higher monitor is better"),
        "async_save": F(bool, True, None, "write in the background"),
        "grace_seconds": F(float, 30.0, (0.0, 86400.0), "SIGTERM/SIGINT: time to save "
                           "and exit"),
        "strict_restore": F(bool, False, None, "a damaged checkpoint ends the run (exit 3) "
                            "instead of falling back"),
        "allow_changes": F("strs", (), None, "config keys (fnmatch) that may change on "
                           "resume"),
        "init_from": F(str, "", None, "an export or a checkpoint to start from when the "
                       "workdir has none"),
        "init_from_step": F(str, "", None, "init_from a run: its step N, latest (\"\" = "
                            "the newest intact) or best (by its checkpoint.monitor)"),
        "init_from_opt": F(bool, False, None, "also take the optimizer state"),
        "init_exclude": F("strs", (), None, "regexes of leaf paths that keep a fresh init"),
        "writer_nice": F(int, 19, (0, 19), "Linux nice of background-write threads"),
        "save_on_best": F(bool, True, None, "an eval that enters the keep_top_k best saves "
                          "its step (when keep_top_k > 0)"),
    }),
    # Run control (jtrain/control): decisions from globally reduced values, state in
    # the checkpoint.
    "early_stop": _resume_safe({
        "monitor": F(str, "", None, "eval metric to watch, e.g. eval/f1; '' = off"),
        "mode": F(str, "min", ("min", "max"), "whether lower or higher is better"),
        "patience": F(int, 5, (1, INF), "evals without improvement before stopping"),
        "min_delta": F(float, 0.0, (0.0, INF), "smallest change that counts as better"),
        "stopping_threshold": F("optfloat", None, None, "stop once the metric is at least "
                                "this good"),
        "divergence_threshold": F("optfloat", None, None, "stop once the metric is worse "
                                  "than this"),
        "check_finite": F(bool, True, None, "stop when the metric is NaN or infinite"),
    }),
    "plateau": {  # changes the learning rate from here on: not resume-safe
        "monitor": F(str, "", None, "eval metric driving ReduceLROnPlateau; '' = off"),
        "mode": F(str, "min", ("min", "max"), "whether lower or higher is better"),
        "factor": F(float, 0.1, (0.0, 1.0), "multiply the learning rate by this, in (0, 1)"),
        "patience": F(int, 3, (0, INF), "evals without improvement before reducing"),
        "cooldown": F(int, 0, (0, INF), "evals to wait after a reduction"),
        "min_lr": F(float, 0.0, (0.0, INF), "optim.lr x the plateau factor never goes "
                     "below this"),
        "min_delta": F(float, 1e-4, (0.0, INF), "smallest change that counts as better"),
    },
    "nonfinite": _resume_safe({
        "policy": F(str, "skip", ("skip", "halt"), "a non-finite loss or gradient norm: "
                    "skip the update, or halt (exit 4)"),
        "max_consecutive": F(int, 8, (1, INF), "skip: halt after this many skips in a row"),
    }),
    "spike": {  # changes the trajectory: not resume-safe
        "zscore": F(float, 0.0, (0.0, INF), "a train loss this many standard deviations "
                    "above the last spike.window steps' mean rolls the run back to the "
                    "newest checkpoint before it and skips the batches since; 0 = off"),
        "window": F(int, 50, (5, 100_000), "steps of train loss the z-score is taken over"),
        "lr_factor": F(float, 1.0, (0.0, 1.0), "learning-rate factor applied at each "
                       "rollback (1 = unchanged)"),
        "max_rollbacks": F(int, 3, (1, INF), "one more spike after this many rollbacks "
                           "halts the run (exit 4)"),
    },
    "watchdog": _resume_safe({
        "timeout_s": F(float, -1.0, (-1.0, INF), "a step, eval or save taking longer "
                       "dumps all stacks and exits 5; 0 = off, -1 = 1800 s with several "
                       "processes, off with one"),
        "first_timeout_s": F(float, 3600.0, (0.0, INF), "allowance for start-up and the "
                             "first step (compile)"),
    }),
    "distributed": _resume_safe({  # jtrain/multihost; read before jax.distributed starts
        "init_timeout_s": F(float, 900.0, (1.0, 86400.0), "start-up: every process must "
                            "reach the coordinator within this (cold starts: image pulls, "
                            "queued pods); else one line naming the missing ids, exit 5"),
        "heartbeat_timeout_s": F(float, 120.0, (1.0, 86400.0), "a peer silent this long "
                                 "(killed, stopped, host gone) ends every survivor with one "
                                 "line, exit 5"),
        "debug_every_steps": F(int, 0, (0, INF), "--debug_multihost: every N steps all "
                               "processes must be at the same step with the same config "
                               "hash; 0 = off"),
    }),
    "memory": _resume_safe({
        "budget_bytes": F(float, 0.0, (-1.0, INF), "per-device bytes the train step may "
                          "use; over it, grad_accum_steps is raised until it fits "
                          "(control.memory); 0 = no planning, -1 = the device's own "
                          "limit (none known on CPU)"),
    }),
    # python -m jtrain.tune (jtrain/tune): read by the tuner only; a plain run ignores it.
    "tune": _resume_safe({
        "space": F("dict", {}, None, "searched keys: {'optim': {'lr': ('log_uniform', "
                   "1e-4, 1e-1)}, 'data': {'batch_size': ('choice', (16, 32))}} (or dotted "
                   "keys from Python); kinds: " + ", ".join(SPACE_KINDS)),
        "trials": F(int, 20, (1, INF), "trials the study runs to the end (complete, pruned "
                    "or failed; a killed trial is continued, not counted twice)"),
        "monitor": F(str, "eval/loss", None, "eval metric optimised: its value at a "
                     "trial's last eval; every eval reports it to the pruner"),
        "mode": F(str, "min", ("min", "max"), "minimise or maximise tune.monitor"),
        "sampler": F(str, "tpe", ("tpe", "random"), "Optuna sampler, seeded with "
                     "tune.seed + the trial number"),
        "seed": F(int, 0, (0, INT_MAX), "seed of the sampler (not of the trials' runs)"),
        "pruner": F(str, "median", ("median", "hyperband", "none"), "stop unpromising "
                    "trials at an eval (Optuna MedianPruner / HyperbandPruner)"),
        "prune_startup_trials": F(int, 5, (0, INF), "median: finished trials before "
                                  "pruning starts"),
        "prune_warmup_steps": F(int, 0, (0, INF), "no pruning at evals before this step"),
        "storage": F(str, "", None, "Optuna RDB URL shared by workers (sqlite:///f.db, "
                     "postgresql://...); '' = sqlite:///WORKDIR/study.db"),
        "study_name": F(str, "", None, "study in the storage; '' = the workdir's name"),
        "stale_after_s": F(float, 300.0, (1.0, INF), "a running trial whose worker has "
                           "not beaten its heartbeat this long is continued by another "
                           "(on the same host: as soon as the worker's process is gone)"),
    }),
}

# Built-in model families: their keys under `model.` (jtrain/models/<name>.py builds them).
MODEL_FAMILIES: dict[str, dict[str, Field]] = {
    "user": {
        "factory": F(str, "", None, "'package.module:function' returning your model "
                     "(Linen, NNX or (init, apply)); jtrain/models/user.py"),
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
    },
    "mlp": {
        "hidden": F("ints", (64, 64), None, "hidden layer widths"),
        "num_outputs": F(int, 10, (1, INF), "classes (or regression outputs)"),
        "dropout": F(float, 0.0, (0.0, 1.0), "dropout rate in [0, 1)"),
        "activation": F(str, "gelu", None, "activation: " + ", ".join(ACTIVATIONS)),
    },
}


def schema_for(model_name: str) -> dict:
    return {**SCHEMA, "model": {**SCHEMA["model"], **MODEL_FAMILIES[model_name]}}


def resume_safe(key: str) -> bool:
    """May the dotted `key` differ on resume without `checkpoint.allow_changes`?"""
    node: Any = SCHEMA
    parts = key.split(".")
    for i, part in enumerate(parts):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif i == 1 and parts[0] == "model":
            return False  # family fields change the model
        else:
            return False
    return isinstance(node, Field) and node.resume


def describe() -> list[tuple[str, Field]]:
    """(dotted key, field) for every key, model families as `model.<key> [family]`."""
    out = []

    def walk(tree, prefix):
        for k, v in tree.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out.append((prefix + k, v))

    walk(SCHEMA, "")
    for family, fields in MODEL_FAMILIES.items():
        out += [(f"model.{k} [{family}]", v) for k, v in fields.items()]
    return out
