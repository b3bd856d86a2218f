"""Rules of single config sections beyond one key's type and range: the mesh, the
optimizer (with the run's total_steps), early stopping, checkpoints, regex lists. Used by
`jtrain.config.validate` for a whole config and by `config.sections` for one section."""

from __future__ import annotations

import re

from jtrain.errors import ConfigError


def check_mesh(mesh: dict) -> None:
    """The `mesh` section's rules beyond one key's type and range."""
    for axis in ("data", "fsdp", "tensor"):
        if mesh[axis] == 0:
            raise ConfigError(f"mesh.{axis}", "must be a positive size or -1, got 0")


# log.train_metrics: eval.metrics' names whose state is computed inside the train step.
NOT_TRAIN_METRICS = {
    "loss": "train/loss is always logged",
    "auroc": "a gathered metric (every prediction is kept on the host), not computable "
             "inside the train step",
    "spearman": "a gathered metric (every prediction is kept on the host), not "
                "computable inside the train step",
    "confusion_matrix": "a matrix, not a scalar to log; precision_recall_f1 summarises it",
}


def check_train_metrics(names) -> None:
    """`log.train_metrics`: only metrics with a fixed-size state the step computes."""
    for name in names:
        if name in NOT_TRAIN_METRICS:
            raise ConfigError("log.train_metrics", f"{name!r}: {NOT_TRAIN_METRICS[name]}; "
                              "train metrics are accuracy, top_k_accuracy, "
                              "precision_recall_f1, perplexity, bits_per_byte, mse, mae, "
                              "r2, pearson")


def check_optim(optim: dict, total_steps: int) -> None:
    """The `optim` section's rules beyond one key's type and range (with the run's
    `total_steps`)."""
    if optim["warmup_steps"] >= total_steps and optim["warmup_steps"] > 0:
        raise ConfigError("optim.warmup_steps",
                          f"{optim['warmup_steps']} >= total_steps={total_steps}: "
                          "the run would never leave warmup; set optim.warmup_steps "
                          "below total_steps")
    decay_end = optim["decay_steps"] or total_steps
    if optim["schedule"] not in ("constant", "rsqrt") and decay_end <= optim["warmup_steps"]:
        raise ConfigError("optim.decay_steps",
                          f"schedule {optim['schedule']!r} decays until step {decay_end} "
                          f"(0 means total_steps={total_steps}), which must be > "
                          f"optim.warmup_steps={optim['warmup_steps']}")
    for beta in ("b1", "b2"):  # (0, 1) inclusive in the schema; 1.0 never forgets
        if optim["name"] not in ("sgd", "adafactor") and optim[beta] >= 1.0:
            raise ConfigError(f"optim.{beta}", f"must be < 1 for {optim['name']}, got "
                              f"{optim[beta]!r} (the moment estimate would never update)")
    if optim["muon_beta"] >= 1.0 and optim["name"] == "muon":
        raise ConfigError("optim.muon_beta", f"must be < 1, got {optim['muon_beta']!r}")
    if optim["name"].startswith("schedule_free"):
        _check_schedule_free(optim)
    if optim["ema"]["decay"] >= 1.0:
        raise ConfigError("optim.ema.decay", f"must be < 1, got {optim['ema']['decay']!r} "
                          "(the average would never move; 0 turns it off)")
    for key in ("trainable", "frozen", "lr_mults"):
        _check_regexes(f"optim.{key}", optim[key])
    for pattern, factor in optim["lr_mults"].items():
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 0:
            raise ConfigError("optim.lr_mults", f"{pattern!r}: the factor must be a "
                              f"number >= 0, got {factor!r}")
    if optim["name"] == "adam" and optim["weight_decay"] > 0:
        raise ConfigError("optim.weight_decay", f"adam has no weight decay (got "
                                                f"{optim['weight_decay']!r}); use adamw")


def _check_schedule_free(optim: dict) -> None:
    if optim["schedule"] != "constant":
        raise ConfigError("optim.schedule", f"{optim['name']} takes a constant learning "
                          f"rate (the average replaces the decay), got "
                          f"{optim['schedule']!r}: set optim.schedule='constant' (with "
                          "optim.warmup_steps for a warmup)")
    if optim["b1"] <= 0.0:
        raise ConfigError("optim.b1", f"must be > 0 for {optim['name']} (the evaluation "
                          f"params divide by it), got {optim['b1']!r}")


def _check_early_stop(es: dict) -> None:
    stop, diverge = es["stopping_threshold"], es["divergence_threshold"]
    if stop is None or diverge is None:
        return
    better = stop < diverge if es["mode"] == "min" else stop > diverge
    if not better:
        raise ConfigError("early_stop.divergence_threshold",
                          f"{diverge!r} is better than stopping_threshold={stop!r} for "
                          f"mode={es['mode']}")


def _check_regexes(key: str, patterns) -> None:
    """ConfigError naming `key` for the first pattern that is not a regex."""
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError(key, f"bad regex {pattern!r}: {e}") from None


def _check_checkpoint(ckpt: dict) -> None:
    _check_regexes("checkpoint.init_exclude", ckpt["init_exclude"])
    init_map = ckpt.get("init_map") or ()
    _check_regexes("checkpoint.init_map", [p for p, _ in (
        init_map.items() if isinstance(init_map, dict) else init_map)])
    if ckpt["keep_top_k"] and not ckpt["monitor"]:
        raise ConfigError("checkpoint.monitor", "required when checkpoint.keep_top_k > 0")
    if ckpt["init_from_opt"] and not ckpt["init_from"]:
        raise ConfigError("checkpoint.init_from_opt", "set checkpoint.init_from too")
