"""The config schema: every key, its type, range and default; `resolve` and `validate`.

This is the only module that knows what a valid config is. Other modules read their
own subtree (`config.optim` in optim.py, ...) and may assume it is valid.

A config is an `ml_collections.ConfigDict` of plain values. Library users may pass a
partial dict; `resolve` fills in the defaults. Every error is a `ConfigError` whose
message starts with the dotted key: `optim.lr: must be finite, got nan`.
"""

from __future__ import annotations

import difflib
import math
from typing import Any

import ml_collections

from jtrain import metrics as metrics_lib
from jtrain import models as models_lib
from jtrain import optim as optim_lib
from jtrain.errors import ConfigError  # noqa: F401  (jtrain.config.ConfigError, as before)


# A field: (type, default, check). Types: int, float, bool, str, "choice:<a|b>", "strs"
# (tuple of str), "dict" (free-form, for kwargs). `check` is a range (lo, hi) with None
# for open ends (inclusive), a tuple of choices, or None.
INF = None
INT_MAX = 2**31 - 1
DTYPES = ("float32", "bfloat16", "float16", "auto")
WRITERS = ("jsonl", "tensorboard", "mlflow", "wandb")

SCHEMA: dict[str, Any] = {
    "seed": (int, 0, (0, 2**31 - 1)),
    "total_steps": (int, 1000, (1, INF)),
    "max_steps_in_flight": (int, 8, (1, 16)),
    "model": {
        "name": (str, "transformer", tuple(models_lib.MODELS)),
        "dtype": (str, "auto", DTYPES),
        "param_dtype": (str, "float32", ("float32", "bfloat16")),
        "loss_scale": (str, "auto", ("auto", "dynamic", "none")),
        "init_scale": (float, 2.0**15, (1.0, 2.0**24)),
        # Family fields are added from jtrain.models for the chosen model.name.
    },
    "optim": {
        "name": (str, "adamw", optim_lib.OPTIMIZERS),
        "lr": (float, 1e-3, (0.0, 10.0)),
        "schedule": (str, "warmup_cosine", optim_lib.SCHEDULES),
        "warmup_steps": (int, 0, (0, INF)),
        "decay_steps": (int, 0, (0, INF)),
        "end_lr_factor": (float, 0.0, (0.0, 1.0)),
        "weight_decay": (float, 0.0, (0.0, 10.0)),
        "decay_embeddings": (bool, False, None),
        "clip_norm": (float, 0.0, (0.0, INF)),
        "grad_accum_steps": (int, 1, (1, 4096)),
        "b1": (float, 0.9, (0.0, 1.0)),
        "b2": (float, 0.999, (0.0, 1.0)),
        "eps": (float, 1e-8, (0.0, 1.0)),
        "momentum": (float, 0.9, (0.0, 1.0)),
        "nesterov": (bool, False, None),
    },
    "data": {
        "name": (str, "pystdlib", None),  # built-in dataset; checked by jtrain.data
        "batch_size": (int, 32, (1, INF)),  # global, over all processes
        "seq_len": (int, 128, (1, INF)),
        "val_fraction": (float, 0.05, (0.0, 0.9)),  # held out when there is no eval data
        "split_seed": (int, 0, (0, 2**31 - 1)),  # that split's seed (not the run's seed)
        "shuffle": (bool, True, None),  # reshuffled per epoch from (seed, epoch)
        "drop_last": (bool, True, None),  # False: the last batch is padded, with a mask
        "num_workers": (int, 0, (0, 256)),  # grain worker processes (spawned)
        # Reader threads per process / worker, for I/O-bound datasets; 0 = read in the
        # device-prefetch thread (fastest for in-memory data: Python holds the GIL).
        "num_threads": (int, 0, (0, 256)),
        "prefetch": (int, 2, (0, 1024)),  # batches read ahead on the host (per worker)
        "device_prefetch": (int, -1, (-1, 16)),  # batches put on devices ahead; 0 off, -1 auto
        # A factory "package.module:function" called with `kwargs`, returning the data
        # (any jtrain input, or {"train": ..., "eval": ...}); overrides `name`.
        "source": (str, "", None),
        "kwargs": ("dict", {}, None),
        "transform": (str, "", None),  # "package.module:fn", fn(item, rng) on train items
    },
    "mesh": {
        "data": (int, -1, (-1, INF)),
        "fsdp": (int, 1, (-1, INF)),
        "tensor": (int, 1, (-1, INF)),
    },
    "eval": {
        "every_steps": (int, 200, (0, INF)),  # 0 = only at the end
        "num_batches": (int, 0, (0, INF)),  # 0 = the whole eval set
        "batch_size": (int, 0, (0, INF)),  # 0 = data.batch_size
        # jtrain.metrics.METRIC_NAMES; () = the task's defaults (classification, sequence,
        # regression: see jtrain/metrics/tasks.py)
        "metrics": ("strs", (), metrics_lib.METRIC_NAMES),
        "top_k": (int, 5, (1, INF)),  # k of top_k_accuracy
        "max_gathered": (int, 1_000_000, (1, INF)),  # AUROC / Spearman keep this many, exact
    },
    "log": {
        "every_steps": (int, 50, (1, INF)),
        "writers": ("strs", ("jsonl", "tensorboard"), WRITERS),
        "verbosity": (int, 1, (0, 2)),  # 0 errors + summary, 1 default, 2 debug
        "all_hosts": (bool, False, None),  # processes other than 0 print too (--all_hosts_log)
        "mlflow_tracking_uri": (str, "", None),
        "mlflow_experiment": (str, "jtrain", None),
        "wandb_project": (str, "jtrain", None),
        "wandb_mode": (str, "offline", ("offline", "online", "disabled")),
    },
    "profile": {
        "start_step": (int, 0, (0, INF)),  # 0 = no trace; else a jax.profiler trace ...
        "num_steps": (int, 5, (1, INF)),  # ... of this many steps, into WORKDIR/profile
    },
    "perf": {
        "peak_flops": (float, 0.0, (0.0, INF)),  # per device, for MFU; 0 = from the device
    },
    "checkpoint": {  # read by jtrain.checkpoint; see its docstring
        "every_steps": (int, 500, (0, INF)),  # 0 = only at the end
        "every_seconds": (float, 0.0, (0.0, INF)),  # 0 = off
        "max_to_keep": (int, 3, (1, INF)),  # keep the latest K (the latest always stays)
        "keep_every_steps": (int, 0, (0, INF)),  # also keep steps that are multiples
        "keep_top_k": (int, 1, (0, INF)),  # also keep the k best by `monitor`
        "monitor": (str, "eval/loss", None),
        "mode": (str, "min", ("min", "max")),
        "async_save": (bool, True, None),
        "grace_seconds": (float, 30.0, (0.0, 86400.0)),  # SIGTERM/SIGINT -> save, exit
        "strict_restore": (bool, False, None),  # damaged checkpoint: exit 3, no fallback
        "allow_changes": ("strs", (), None),  # config keys (fnmatch) that may change on resume
        "init_from": (str, "", None),  # an export or a checkpoint, used with no checkpoint
        "init_from_opt": (bool, False, None),  # also take the optimizer state
        "init_exclude": ("strs", (), None),  # regexes of leaf paths that keep fresh init
        "writer_nice": (int, 19, (0, 19)),  # Linux nice of background-write threads
    },
}


def _schema_for(model_name: str) -> dict:
    schema = dict(SCHEMA)
    model = dict(SCHEMA["model"])
    for key, value in models_lib.default_model_config(model_name).items():
        if key == "name":
            continue
        model[key] = (_type_of(value), value, None)
    schema["model"] = model
    return schema


def _type_of(value):
    if isinstance(value, bool):
        return bool
    if isinstance(value, int):
        return int
    if isinstance(value, float):
        return float
    if isinstance(value, str):
        return str
    if isinstance(value, (tuple, list)):
        return "ints" if all(isinstance(v, int) for v in value) else "strs"
    return "dict"


def defaults(model: str = "transformer") -> ml_collections.ConfigDict:
    """A complete config of defaults for a built-in model family."""

    def build(schema):
        out = {}
        for key, spec in schema.items():
            if isinstance(spec, dict):
                out[key] = build(spec)
            else:
                default = spec[1]
                out[key] = dict(default) if isinstance(default, dict) else default
        return out

    tree = build(_schema_for(model))
    tree["model"]["name"] = model
    return ml_collections.ConfigDict(tree)


def _as_dict(config) -> dict:
    if config is None:
        return {}
    if isinstance(config, ml_collections.ConfigDict):
        return config.to_dict()
    if isinstance(config, dict):
        return {k: _as_dict(v) if isinstance(v, (dict, ml_collections.ConfigDict)) else v
                for k, v in config.items()}
    raise ConfigError("config", f"expected a dict or ConfigDict, got {type(config).__name__}")


def resolve(config=None) -> ml_collections.ConfigDict:
    """Defaults overlaid with `config` (partial dicts allowed), validated."""
    user = _as_dict(config)
    model_name = (user.get("model") or {}).get("name", "transformer")
    if not isinstance(model_name, str) or model_name not in models_lib.MODELS:
        _check_value("model.name", str, tuple(models_lib.MODELS), model_name)
    merged = defaults(model_name).to_dict()
    _overlay(merged, user, _schema_for(model_name), prefix="")
    cfg = ml_collections.ConfigDict(merged)
    validate(cfg)
    return cfg


def _overlay(base: dict, user: dict, schema: dict, prefix: str) -> None:
    for key, value in user.items():
        dotted = f"{prefix}{key}"
        if key not in schema:
            _unknown(dotted, key, schema)
        spec = schema[key]
        if isinstance(spec, dict):
            if not isinstance(value, dict):
                raise ConfigError(dotted, f"must be a section (dict), got {value!r}")
            _overlay(base[key], value, spec, prefix=dotted + ".")
        else:
            base[key] = value


def _unknown(dotted: str, key: str, schema: dict):
    close = difflib.get_close_matches(key, list(schema), n=1, cutoff=0.6)
    hint = f'; did you mean "{close[0]}"?' if close else ""
    raise ConfigError(dotted, f"unknown key{hint}")


def validate(config, num_devices: int | None = None) -> None:
    """Raises ConfigError for the first bad key. With `num_devices`, also checks the
    mesh and the batch against the devices that will run it."""
    tree = _as_dict(config)
    model_name = (tree.get("model") or {}).get("name")
    _check_value("model.name", str, tuple(models_lib.MODELS), model_name)
    schema = _schema_for(model_name)
    _validate_tree(tree, schema, prefix="")
    _check_cross(tree, num_devices)


def _validate_tree(tree: dict, schema: dict, prefix: str) -> None:
    for key in tree:
        if key not in schema:
            _unknown(prefix + key, key, schema)
    for key, spec in schema.items():
        dotted = prefix + key
        if key not in tree:
            raise ConfigError(dotted, "missing")
        if isinstance(spec, dict):
            if not isinstance(tree[key], dict):
                raise ConfigError(dotted, f"must be a section (dict), got {tree[key]!r}")
            _validate_tree(tree[key], spec, dotted + ".")
        else:
            _check_value(dotted, spec[0], spec[2], tree[key])


def _check_value(key: str, typ, check, value) -> None:
    if typ is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"must be true or false, got {value!r}")
        return
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"must be an integer, got {value!r}")
    elif typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(key, f"must be finite, got {value!r}")
    elif typ is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"must be a string, got {value!r}")
        if isinstance(check, tuple) and value not in check:
            close = difflib.get_close_matches(value, check, n=1, cutoff=0.6)
            hint = f' (did you mean "{close[0]}"?)' if close else ""
            raise ConfigError(key, f"must be one of {', '.join(check)}; got {value!r}{hint}")
        return
    elif typ in ("strs", "ints"):
        if isinstance(value, str) or not isinstance(value, (tuple, list)):
            raise ConfigError(key, f"must be a list, got {value!r}")
        want = str if typ == "strs" else int
        for v in value:
            if not isinstance(v, want) or isinstance(v, bool):
                raise ConfigError(key, f"items must be {want.__name__}, got {v!r}")
            if isinstance(check, tuple) and v not in check:
                raise ConfigError(key, f"unknown item {v!r}; choose from {', '.join(check)}")
            if want is int and v <= 0:
                raise ConfigError(key, f"items must be positive, got {v!r}")
        return
    elif typ == "dict":
        if not isinstance(value, dict):
            raise ConfigError(key, f"must be a dict, got {value!r}")
        return
    if isinstance(check, tuple) and len(check) == 2 and not isinstance(check[0], str):
        lo, hi = check
        if typ is int and hi is None:
            hi = INT_MAX  # steps and sizes become int32 on device
        if lo is not None and value < lo:
            raise ConfigError(key, f"must be >= {lo}, got {value!r}")
        if hi is not None and value > hi:
            raise ConfigError(key, f"must be <= {hi}, got {value!r}")


def _check_cross(tree: dict, num_devices: int | None) -> None:
    """Rules that involve more than one key."""
    _check_checkpoint(tree["checkpoint"])
    _check_data(tree["data"])
    mesh = tree["mesh"]
    for axis in ("data", "fsdp", "tensor"):
        if mesh[axis] == 0:
            raise ConfigError(f"mesh.{axis}", "must be a positive size or -1, got 0")
    optim = tree["optim"]
    if optim["warmup_steps"] >= tree["total_steps"] and optim["warmup_steps"] > 0:
        raise ConfigError("optim.warmup_steps",
                          f"{optim['warmup_steps']} >= total_steps={tree['total_steps']}: "
                          "the run would never leave warmup")
    if optim["name"] == "adam" and optim["weight_decay"] > 0:
        raise ConfigError("optim.weight_decay", "adam has no weight decay; use optim.name=adamw")
    batch = tree["data"]["batch_size"]
    accum = optim["grad_accum_steps"]
    if batch % accum:
        raise ConfigError("optim.grad_accum_steps",
                          f"data.batch_size={batch} is not divisible by grad_accum_steps={accum}")
    model = tree["model"]
    try:  # the family's own checks (head size, dropout, ...); builds no arrays
        models_lib.make_model(model, dtype=None, param_dtype=None)
    except ValueError as e:
        key, _, why = str(e).partition(": ")
        raise (ConfigError(key, why) if key.startswith("model.") and why
               else ConfigError("model", str(e))) from None
    if model["name"] == "transformer" and tree["data"]["seq_len"] > model.get("max_len", 0):
        raise ConfigError("data.seq_len",
                          f"{tree['data']['seq_len']} exceeds model.max_len={model['max_len']}")
    if num_devices is None:
        return
    from jtrain import mesh as mesh_lib  # only the device check needs it

    try:
        data, fsdp, tensor = mesh_lib.resolve_axis_sizes(mesh, num_devices)
    except ValueError as e:
        key, why = str(e).split(": ", 1)
        raise ConfigError(key, why) from None
    dp = data * fsdp
    if batch % dp:
        raise ConfigError("data.batch_size",
                          f"global batch {batch} is not divisible by the data-parallel size "
                          f"{dp} (mesh.data={data} x mesh.fsdp={fsdp})")
    if (batch // dp) % accum:
        raise ConfigError("optim.grad_accum_steps",
                          f"the per-device batch {batch // dp} is not divisible by "
                          f"grad_accum_steps={accum}")
    eval_batch = tree["eval"]["batch_size"] or batch
    if eval_batch % dp:
        raise ConfigError("eval.batch_size",
                          f"{eval_batch} is not divisible by the data-parallel size {dp}")


def _check_data(data: dict) -> None:
    import re

    for key in ("source", "transform"):  # import paths; jtrain.data imports them
        path = data[key]
        if path and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", path):
            raise ConfigError(f"data.{key}",
                              f"expected 'package.module:function', got {path!r}")


def _check_checkpoint(ckpt: dict) -> None:
    import re

    for pattern in ckpt["init_exclude"]:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError("checkpoint.init_exclude", f"bad regex {pattern!r}: {e}") from None
    if ckpt["keep_top_k"] and not ckpt["monitor"]:
        raise ConfigError("checkpoint.monitor", "required when checkpoint.keep_top_k > 0")
    if ckpt["init_from_opt"] and not ckpt["init_from"]:
        raise ConfigError("checkpoint.init_from_opt", "set checkpoint.init_from too")


def config_hash(config) -> str:
    """SHA-256 of the resolved config's canonical JSON."""
    import hashlib
    import json

    text = json.dumps(_as_dict(config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()
