"""What a config key is (Field) and the choices keys draw from; jtrain.config.schema
assembles the keys themselves."""

from __future__ import annotations

from typing import Any, NamedTuple


class Field(NamedTuple):
    """One config key. `type`: int, float, bool, str, "strs" / "ints" (tuples), "dict"
    (free-form kwargs), "pairs" (a list of (str, str)), "optfloat" (a number or None = off; an
    ml_collections float placeholder in config files, so `--config.x=0.5` works). `check`: a range
    (lo, hi) with None for an open end (inclusive), a tuple of choices, or None. `resume`: True when
    the key may differ on resume without `checkpoint.allow_changes` (it cannot change the trained
    state, or, for mesh.*, only the float reduction order)."""
    type: Any
    default: Any
    check: Any
    doc: str
    resume: bool = False


INF = None
INT_MAX = 2**31 - 1

# Choices, declared here; their consumers keep a dict per name (tests check they agree).
DTYPES = ("float32", "bfloat16", "float16", "auto")
# The built-in optimizers (the one list of their names), each with the arguments
# optim.kwargs may give it: optax's names, the defaults filled in by resolve.
OPTIMIZERS: dict[str, dict[str, Field]] = {
    "adamw": {}, "adam": {},
    "sgd": {"momentum": Field(float, 0.9, (0.0, 1.0), "momentum; 0 = plain sgd"),
            "nesterov": Field(bool, False, None, "Nesterov momentum")},
    "lion": {}, "adafactor": {},
    "muon": {"beta": Field(float, 0.95, (0.0, 1.0), "momentum of the 2-D leaves, in [0, 1)"),
             "ns_steps": Field(int, 5, (1, 100), "Newton-Schulz iterations")},
    "schedule_free_adamw": {}, "schedule_free_sgd": {},
    "prodigy": {"estim_lr0": Field(float, 1e-6, (1e-12, 1.0), "initial step-size "
                                   "estimate D0")},
}
# Schedule-free: constant schedule, b1 > 0, evaluated and exported at the average, the
# plateau / spike factor inside the base step (jtrain.optim). optax's own schedule_free*
# functions by name are refused (jtrain.config.rules): they have none of that.
SCHEDULE_FREE = ("schedule_free_adamw", "schedule_free_sgd")


class OpenChoices(tuple):
    """Choices that also take any value starting with `prefix`: optim.name's built-in
    names and any optax.* function (jtrain.optim.named checks that one exists)."""
    prefix = "optax."


OPTIMIZER_CHOICES = OpenChoices(OPTIMIZERS)
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
