"""Rules of single config sections beyond one key's type and range: the mesh (its axis
sizes over the devices), the optimizer (with the run's total_steps), early stopping,
checkpoints, regex lists. Used by `jtrain.config.validate` for a whole config and by
`config.sections` for one section."""

from __future__ import annotations

import math
import re
from typing import NamedTuple

from jtrain.config.fields import OPTIMIZERS, SCHEDULE_FREE
from jtrain.errors import ConfigError


MESH_AXES = ("data", "fsdp", "expert", "context", "tensor", "stage")


def check_mesh(mesh: dict) -> None:
    """The `mesh` section's rules beyond one key's type and range."""
    for axis in MESH_AXES:
        if mesh[axis] == 0:
            raise ConfigError(f"mesh.{axis}", "must be a positive size or -1, got 0")


def resolve_axis_sizes(mesh_cfg, num_devices: int) -> tuple[int, ...]:
    """The sizes of MESH_AXES (data, fsdp, expert, context, tensor, stage); -1 takes the rest.

    Raises ConfigError("mesh.<axis>", why) when the sizes cannot cover num_devices.
    """
    sizes = {a: int(mesh_cfg[a]) for a in MESH_AXES}
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ConfigError(f"mesh.{free[1]}",
                          f"only one axis may be -1, got -1 for {', '.join(free)}")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    # The key to change: a set axis that does not divide the devices, else any set axis.
    set_axes = [a for a, s in sizes.items() if s not in (-1, 1)]
    bad = [a for a in set_axes if num_devices % sizes[a]] or set_axes or ["data"]
    if free:
        if num_devices % fixed:
            raise ConfigError(
                f"mesh.{bad[-1]}", f"the axes other than mesh.{free[0]}=-1 multiply to "
                f"{fixed}, which does not divide the {num_devices} devices")
        sizes[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ConfigError(
            f"mesh.{bad[-1]}", f"{'*'.join(MESH_AXES)} = "
            f"{'*'.join(str(sizes[a]) for a in MESH_AXES)} = {fixed}, but there are "
            f"{num_devices} devices (-1 on one axis takes the rest)")
    return tuple(sizes[a] for a in MESH_AXES)


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
        if optim["name"] in OPTIMIZERS and optim["name"] not in ("sgd", "adafactor") \
                and optim[beta] >= 1.0:
            raise ConfigError(f"optim.{beta}", f"must be < 1 for {optim['name']}, got "
                              f"{optim[beta]!r} (the moment estimate would never update)")
    if optim["name"] == "muon" and optim["kwargs"].get("beta", 0.0) >= 1.0:
        raise ConfigError("optim.kwargs.beta", f"must be < 1, got "
                          f"{optim['kwargs']['beta']!r}")
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
    """Schedule-free's rules; optax's own schedule_free* by name has no average that
    eval and export use and no place for the plateau / spike factor: refused."""
    name = optim["name"]
    if name.startswith("optax.contrib.schedule_free"):
        raise ConfigError("optim.name", f"{name} by name is not supported (eval, export and "
                          "the lr factor would miss its average); use optim.name="
                          "'schedule_free_adamw' or 'schedule_free_sgd' (built in)")
    if name not in SCHEDULE_FREE:
        return
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


def _check_init(init: dict) -> None:
    _check_regexes("init.exclude", init["exclude"])
    _check_regexes("init.map", [p for p, _ in (
        init["map"].items() if isinstance(init["map"], dict) else init["map"])])
    if init["opt"] and not init["path"]:
        raise ConfigError("init.opt", "set init.path too")


def _check_checkpoint(ckpt: dict) -> None:
    if ckpt["keep_top_k"] and not ckpt["monitor"]:
        raise ConfigError("checkpoint.monitor", "required when checkpoint.keep_top_k > 0")
    if bool(ckpt["local_dir"]) != bool(ckpt["local_every_steps"]):
        key = "checkpoint.local_every_steps" if ckpt["local_dir"] else "checkpoint.local_dir"
        raise ConfigError(key, "the local checkpoint tier needs both checkpoint.local_dir "
                          "and checkpoint.local_every_steps > 0")
    if "://" in ckpt["local_dir"]:
        raise ConfigError("checkpoint.local_dir", f"{ckpt['local_dir']!r} is not a local "
                          "path: the local tier is a folder on this machine's disk")


# debug.faults: the kinds, and what each takes besides its step (jtrain.control.faults).
FAULT_KINDS = ("kill", "hang", "slow", "nan", "torn_ckpt", "writer_fail", "lost_local")
_FAULT_TAKES = {"kill": "p", "hang": "ps", "slow": "psr", "nan": "", "torn_ckpt": "",
                "writer_fail": "", "lost_local": ""}  # p: a process, s: seconds, r: a step range
_FAULT_SYNTAX = "KIND@STEP[-STEP][:pI][:SECONDSs], comma-separated"


class Fault(NamedTuple):
    """One injected fault of debug.faults. `text`: as written (its identity in
    WORKDIR/faults.jsonl); `first`..`last`: its steps; `process`: None = every
    process; `seconds`: a slow step's extra time, a hang's length (None: for good)."""
    text: str
    kind: str
    first: int
    last: int
    process: int | None
    seconds: float | None


def parse_faults(text: str, total_steps: int | None = None) -> list[Fault]:
    """debug.faults -> its faults, or a ConfigError naming the key and the fault."""
    out: list[Fault] = []
    for item in (s.strip() for s in str(text or "").split(",")):
        if not item:
            continue
        fault = _parse_fault(item)
        if fault.text in {f.text for f in out}:
            raise ConfigError("debug.faults", f"{item!r} is given twice")
        if total_steps is not None and fault.first > total_steps:
            raise ConfigError("debug.faults", f"{item!r}: step {fault.first} is after "
                              f"total_steps={total_steps}; it would never fire")
        out.append(fault)
    return out


def _parse_fault(item: str) -> Fault:
    def bad(why: str) -> ConfigError:
        return ConfigError("debug.faults", f"{item!r}: {why} (syntax: {_FAULT_SYNTAX})")

    head, *options = item.split(":")
    kind, at, steps = head.partition("@")
    if kind not in _FAULT_TAKES:
        raise bad(f"unknown kind {kind!r}; kinds: {', '.join(FAULT_KINDS)}")
    takes = _FAULT_TAKES[kind]
    first_s, dash, last_s = steps.partition("-")
    if not at or not _digits(first_s) or (dash and not _digits(last_s)):
        raise bad("expected a step number after '@'")
    first, last = int(first_s), int(last_s or first_s)
    if dash and "r" not in takes:
        raise bad(f"{kind} takes one step, not a range")
    if first < 1 or last < first:
        raise bad("steps start at 1 and a range goes up")
    process = seconds = None
    for option in options:
        if option[:1] == "p" and _digits(option[1:]) and process is None:
            if "p" not in takes:
                raise bad(f"{kind} takes no process: " + (
                    "the loss is the same on every process" if kind == "nan" else
                    "process 0 does it (it writes the checkpoint's commit and the metrics)"))
            process = int(option[1:])
        elif option.endswith("s") and seconds is None and _number(option[:-1]) is not None:
            if "s" not in takes:
                raise bad(f"{kind} takes no seconds")
            seconds = _number(option[:-1])
        else:
            raise bad(f"cannot read {option!r}: a process is pI (p0, p1, ...), a length "
                      "is seconds with an s (0.5s)")
    if kind == "slow" and seconds is None:
        raise bad("a slow fault needs its seconds per step (slow@5-9:0.2s)")
    return Fault(item, kind, first, last, process, seconds)


def _digits(text: str) -> bool:
    """ASCII digits only: str.isdigit accepts '²', which int() then refuses."""
    return re.fullmatch("[0-9]+", text) is not None


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if value >= 0 and value == value and value != float("inf") else None


def check_stage(tree, dp: int | None = None) -> None:
    """mesh.stage > 1 (a pipeline over the built-in transformer's blocks): what it needs
    and what it refuses; with `dp` (data x fsdp), the batches' split into microbatches."""
    stages, m = tree["mesh"]["stage"], tree["mesh"]["microbatches"]
    if stages == 1:
        return
    model = tree["model"]
    refused = (
        (model["name"] != "transformer", "mesh.stage", "pipeline stages split the built-in "
         f"transformer's layer stack; model.name={model['name']} runs with mesh.stage=1"),
        (model.get("num_layers", 0) % stages, "mesh.stage", f"model.num_layers="
         f"{model.get('num_layers')} does not split into {stages} equal stages"),
        ((model.get("moe") or {}).get("experts"), "model.moe.experts", "a mixture of "
         "experts is not implemented with pipeline stages (mesh.stage > 1)"),
        (tree["finetune"]["lora"]["rank"], "finetune.lora.rank", "LoRA adapters do not "
         "wrap a pipeline's stacked blocks (mesh.stage > 1)"),
        (model.get("quant", "none") != "none", "model.quant", "quantised matmuls are not "
         "implemented with pipeline stages (mesh.stage > 1)"),
        (tree["population"]["size"] > 1, "population.size", "a population is not "
         "implemented with pipeline stages (mesh.stage > 1)"),
        (tree["determinism"]["topology_invariant"], "determinism.topology_invariant",
         "programs compiled for one device have no stage axis; set mesh.stage=1"))
    for bad, key, why in refused:
        if bad:
            raise ConfigError(key, why)
    if dp is None:
        return
    rows = tree["data"]["batch_size"] // tree["optim"]["grad_accum_steps"]
    for key, n in (("data.batch_size", rows), ("eval.batch_size",
                                               tree["eval"]["batch_size"] or rows)):
        if n % (dp * m):
            raise ConfigError(key, f"{n} rows per forward pass do not split into "
                              f"mesh.microbatches={m} microbatches over the data-parallel "
                              f"size {dp}")
