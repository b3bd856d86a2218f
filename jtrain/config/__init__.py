"""The one home of the config: every key once, with its type, default, allowed range or
choices, a one-line description and whether it may change when a run resumes; `resolve`
and `validate` (the modules: WORKSPACE.md's map; the keys: docs/reference/config.md).

This is the only module that knows what a valid config is, and the only place a default
lives. Each subtree has one reader (`config.optim` in optim.py, `config.data` in
jtrain.data, ...), which may assume it is valid. Model keys are declared per built-in
family (`MODEL_FAMILIES`); `model.name` picks the family whose keys apply.

A config is an `ml_collections.ConfigDict` of plain values. Library users may pass a
partial dict; `resolve` fills in the defaults and returns a new validated ConfigDict
(it is never changed afterwards: a change builds a new one). Every error is a
`ConfigError` whose message starts with the dotted key: `optim.lr: must be finite, got nan`.
Modules: schema (with fields, schema_control, schema_population), reference, space,
sections, rules, renamed, named, changes, interactions.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import re
from typing import Any

import ml_collections

from jtrain.config.schema import (ACTIVATIONS, DTYPES, INT_MAX, METRIC_NAMES,  # noqa: F401
                                  MODEL_FAMILIES, OPTIMIZERS, SCHEDULES, SCHEMA, WRITERS,
                                  Field, describe, field_of, fields, resume_safe, schema_for)
from jtrain.config import renamed, schema_population, space as space_lib
from jtrain.config.fields import OpenChoices
from jtrain.config.rules import (  # noqa: F401  (config.check_mesh, config.check_optim)
    _check_checkpoint, _check_early_stop, _check_init, _check_regexes, check_mesh,
    MESH_AXES, check_optim, check_stage, check_train_metrics, parse_faults,
    resolve_axis_sizes)
from jtrain.errors import ConfigError  # noqa: F401  (jtrain.config.ConfigError)


def _build(schema: dict) -> dict:
    """The defaults of a (sub)schema as a fresh nested dict."""
    out = {}
    for key, spec in schema.items():
        if isinstance(spec, dict):
            out[key] = _build(spec)
        else:
            out[key] = dict(spec.default) if isinstance(spec.default, dict) else spec.default
    return out


def defaults(model: str = "transformer") -> ml_collections.ConfigDict:
    """A complete config of defaults for a built-in model family.

    Examples:
        ```python
        import jtrain

        cfg = jtrain.defaults("mlp")       # or "transformer"
        cfg.total_steps = 200
        cfg.model.hidden = (64, 64)
        print(cfg.optim.name, cfg.data.batch_size)
        ```
    """
    _check_value("model.name", str, tuple(MODEL_FAMILIES), model)
    tree = _build(schema_for(model))
    tree["model"]["name"] = model
    config = ml_collections.ConfigDict(tree)
    for key, spec in fields(schema_for(model)):  # None-able numbers: typed placeholders
        if spec.type == "optfloat":
            section, name = key.rsplit(".", 1)
            config[section][name] = ml_collections.config_dict.placeholder(float)
    return config


def variant_of(path: str, variant, choices) -> str:
    """A config file's `:variant` ('' for none); ValueError naming the file and the
    choices for any other."""
    if (variant or "") not in choices:
        raise ValueError(f"{path}: unknown variant {variant!r}; choose one of: "
                         + ", ".join(c for c in choices if c))
    return variant or ""


def _as_dict(config) -> dict:
    if config is None:
        return {}
    if isinstance(config, ml_collections.ConfigDict):
        return config.to_dict()
    if isinstance(config, dict):
        return {k: _as_dict(v) if isinstance(v, (dict, ml_collections.ConfigDict)) else v
                for k, v in config.items()}
    raise ConfigError("config", f"expected a dict or ConfigDict, got {type(config).__name__}")


def resolve(config=None, *, data_settings=None) -> ml_collections.ConfigDict:
    """Defaults overlaid with `config` (partial dicts allowed), validated.

    `data_settings(data_cfg) -> {key: value}`: called once with the validated `data`
    section; what it returns overrides `data.*` in this same resolution (a torch
    DataLoader's batch size, shuffle, ... read by jtrain.data before anything else reads
    the config).

    Examples:
        ```python
        import jtrain

        cfg = jtrain.resolve({"total_steps": 100, "optim": {"lr": 3e-4}})
        print(cfg.optim.name, cfg.optim.lr)       # the rest are the defaults

        jtrain.resolve({"optim": {"lr": -1.0}})    # raises jtrain.ConfigError naming optim.lr
        ```
    """
    user = schema_population.nest_vary(space_lib.nest_dotted(_as_dict(config)))
    user, _ = renamed.apply(user)  # resolve_for_run prints the note
    init_map = (user.get("init") or {}).get("map")
    if isinstance(init_map, dict):  # regexes hold dots, which a ConfigDict key may not
        user = {**user, "init": {**user["init"], "map": tuple(init_map.items())}}
    model_name = (user.get("model") or {}).get("name", "transformer")
    _check_value("model.name", str, tuple(MODEL_FAMILIES), model_name)
    schema = schema_for(model_name)
    merged = defaults(model_name).to_dict()
    _overlay(merged, user, schema, prefix="")
    optim_kwargs(merged["optim"])
    data = merged["data"]
    if (data["packing"] != "none" or data["name"] == "chat") and model_name == "transformer" \
            and not data["model_inputs"]:
        data["model_inputs"] = ("inputs", "segment_ids", "positions")  # masks by segment
    cfg = ml_collections.ConfigDict(merged)
    validate(cfg)
    overrides = data_settings(cfg.data) if data_settings is not None else None
    if overrides:
        _overlay(merged["data"], overrides, schema["data"], prefix="data.")
        cfg = ml_collections.ConfigDict(merged)
        validate(cfg)
    return cfg


def resolve_for_run(config=None, allow_changes=(), *, data_settings=None
                    ) -> tuple[ml_collections.ConfigDict, list[str]]:
    """`resolve` for a run, after fitting a warmup that does not end before `total_steps`
    (a short smoke run of a shipped config, `--config.total_steps=10`) into the run: it
    becomes a tenth of the run. `allow_changes` (jtrain.train's argument) is added to
    checkpoint.allow_changes; `data_settings` as in `resolve`. Returns the new config and
    one notice line per change made; `config` itself is left as it was."""
    user, note = renamed.apply(space_lib.nest_dotted(_as_dict(config)))  # a copy
    if allow_changes:
        if isinstance(allow_changes, str):
            allow_changes = [allow_changes]
        ckpt = user.get("checkpoint") or {}
        if not isinstance(ckpt, dict):
            raise ConfigError("checkpoint", f"must be a section (dict), got {ckpt!r}")
        user["checkpoint"] = {**ckpt, "allow_changes": tuple(ckpt.get("allow_changes", ()))
                              + tuple(allow_changes)}
    total = user.get("total_steps", SCHEMA["total_steps"].default)
    optim = user.get("optim") or {}
    warmup = optim.get("warmup_steps", 0) if isinstance(optim, dict) else 0
    notices = [note] if note else []
    if (all(isinstance(v, int) and not isinstance(v, bool) for v in (total, warmup))
            and 0 < total <= warmup):
        user["optim"] = {**optim, "warmup_steps": total // 10}
        notices.append(f"optim.warmup_steps={warmup} does not end before total_steps="
                       f"{total}: using {total // 10} (a tenth of the run) for this run; "
                       "set optim.warmup_steps below total_steps to choose")
    return resolve(user, data_settings=data_settings), notices


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


def optim_kwargs(optim: dict) -> None:
    """A built-in optim.name's arguments in `optim` (a dict, changed in place): each
    given one checked, the rest at their defaults. An optax.* name's are its own
    (jtrain.optim.named checks them against the function)."""
    args = OPTIMIZERS.get(optim["name"])
    if args is None:
        return
    given = optim["kwargs"]  # a dict here: resolve and sections pass plain dicts
    _check_value("optim.kwargs", "dict", None, given)
    for key in given:
        if key not in args:
            raise ConfigError(f"optim.kwargs.{key}", f"{optim['name']} takes no argument "
                              f"{key!r}; it takes: {', '.join(args) or 'none'}")
    optim["kwargs"] = {k: given.get(k, f.default) for k, f in args.items()}
    for key, f in args.items():
        _check_value(f"optim.kwargs.{key}", f.type, f.check, optim["kwargs"][key])


def _unknown(dotted: str, key: str, schema: dict):
    why = renamed.new_name(dotted)
    if why:
        raise ConfigError(dotted, why)
    close = difflib.get_close_matches(key, list(schema), n=1, cutoff=0.6)
    hint = f'; did you mean "{close[0]}"?' if close else ""
    raise ConfigError(dotted, f"unknown key{hint}")


def validate(config, num_devices: int | None = None) -> None:
    """Raises ConfigError for the first bad key. With `num_devices`, also checks the
    mesh and the batch against the devices that will run it."""
    tree = _as_dict(config)
    model_name = (tree.get("model") or {}).get("name")
    _check_value("model.name", str, tuple(MODEL_FAMILIES), model_name)
    assert isinstance(model_name, str)  # _check_value raised ConfigError otherwise
    schema = schema_for(model_name)
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
    if typ == "optfloat":
        if value is None:
            return
        typ = float
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
        if isinstance(check, tuple) and value not in check and not (
                isinstance(check, OpenChoices) and value.startswith(check.prefix)):
            close = difflib.get_close_matches(value, check, n=1, cutoff=0.6)
            hint = f' (did you mean "{close[0]}"?)' if close else ""
            more = f" or {check.prefix}<name>" if isinstance(check, OpenChoices) else ""
            raise ConfigError(key, f"must be one of {', '.join(check)}{more}; got "
                                   f"{value!r}{hint}")
        return
    elif typ in ("strs", "ints"):
        if isinstance(value, str) or not isinstance(value, (tuple, list)):
            raise ConfigError(key, f"must be a list, got {value!r}")
        want: type[Any] = str if typ == "strs" else int
        for v in value:
            if not isinstance(v, want) or isinstance(v, bool):
                raise ConfigError(key, f"items must be {want.__name__}, got {v!r}")
            ranged = want is int and isinstance(check, tuple) and check[:1] == (0,)
            if isinstance(check, tuple) and not ranged and v not in check:
                raise ConfigError(key, f"unknown item {v!r}; choose from {', '.join(check)}")
            if ranged:
                if v < 0:  # a (0, hi) range: zero allowed (population.seeds)
                    raise ConfigError(key, f"items must be >= 0, got {v!r}")
            elif want is int and v <= 0:
                raise ConfigError(key, f"items must be positive, got {v!r}")
        return
    elif typ == "dict":
        if not isinstance(value, dict):
            raise ConfigError(key, f"must be a dict, got {value!r}")
        return
    elif typ == "pairs":  # [(str, str), ...]; a dict of str -> str is taken as its items
        items = value.items() if isinstance(value, dict) else value
        if isinstance(value, str) or not isinstance(value, (tuple, list, dict)) or any(
                not isinstance(p, (tuple, list)) or len(p) != 2
                or not all(isinstance(x, str) for x in p) for p in items):
            raise ConfigError(key, f"must be a list of (str, str) pairs, got {value!r}")
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
    _check_init(tree["init"])
    _check_data(tree["data"])
    mesh = tree["mesh"]
    check_mesh(mesh)
    optim = tree["optim"]
    optim_kwargs(dict(optim))  # checked, not filled: a resolved config has them all
    check_optim(optim, tree["total_steps"])
    if not 0.0 < tree["plateau"]["factor"] < 1.0:
        raise ConfigError("plateau.factor", f"must be in (0, 1), got "
                          f"{tree['plateau']['factor']!r}")
    _check_early_stop(tree["early_stop"])
    schema_population.check(tree)
    check_train_metrics(tree["log"]["train_metrics"])
    faults = parse_faults(tree["debug"]["faults"], tree["total_steps"])
    lost = [f.text for f in faults if f.kind == "lost_local"]
    if lost and not tree["checkpoint"]["local_dir"]:
        raise ConfigError("debug.faults", f"{lost[0]!r} deletes the local checkpoint tier: "
                          "set checkpoint.local_dir and checkpoint.local_every_steps")
    if tree["eval"]["weights"] != "params" and not optim["ema"]["decay"]:
        raise ConfigError("eval.weights", f"{tree['eval']['weights']!r} evaluates the "
                          "weight EMA: set optim.ema.decay > 0 (e.g. 0.999)")
    if tree["spike"]["zscore"] > 0 and not tree["checkpoint"]["every_steps"]:
        raise ConfigError("spike.zscore", "a rollback restores the newest periodic "
                          "checkpoint: set checkpoint.every_steps > 0")
    if tree["spike"]["lr_factor"] <= 0.0:
        raise ConfigError("spike.lr_factor", f"must be in (0, 1], got "
                          f"{tree['spike']['lr_factor']!r}")
    if -1.0 < tree["memory"]["budget_bytes"] < 0.0:
        raise ConfigError("memory.budget_bytes", "must be -1 (the device's limit), 0 (no "
                          f"planning) or a number of bytes, got "
                          f"{tree['memory']['budget_bytes']!r}")
    _check_regexes("model.keep_fp32", tree["model"]["keep_fp32"])
    batch = tree["data"]["batch_size"]
    accum = optim["grad_accum_steps"]
    if batch % accum:
        raise ConfigError("optim.grad_accum_steps",
                          f"data.batch_size={batch} is not divisible by grad_accum_steps={accum}")
    model = tree["model"]
    _check_family(model)
    space_lib.check(tree["tune"]["space"], schema_for(model["name"]), _check_value)
    space_lib.check_population(tree["tune"])
    if model["name"] == "transformer" and tree["data"]["seq_len"] > model.get("max_len", 0):
        raise ConfigError("data.seq_len",
                          f"{tree['data']['seq_len']} exceeds model.max_len={model['max_len']}")
    if (model.get("moe") or {}).get("experts") and tree["finetune"]["lora"]["rank"]:
        raise ConfigError("finetune.lora.rank", "LoRA adapters do not wrap the experts of "
                          "model.moe.experts > 0; train the mixture of experts without LoRA")
    if model.get("quant_scaling") == "delayed":
        raise ConfigError("model.quant_scaling", "delayed scaling (an amax history kept "
                          "in the train state) is not in qwix 0.1.8, which scales each "
                          "matmul from its operands' absmax in the batch; use 'current'")
    if (model.get("moe") or {}).get("experts") and model.get("quant", "none") != "none":
        raise ConfigError("model.quant", f"{model['quant']} is not implemented for "
                          "model.moe.experts > 0 (the experts' matmuls would run unquantised); "
                          "set model.quant='none' or model.moe.experts=0")
    check_stage(tree)
    if num_devices is None:
        return
    sizes = dict(zip(MESH_AXES, resolve_axis_sizes(mesh, num_devices), strict=True))
    data, fsdp, expert = sizes["data"], sizes["fsdp"], sizes["expert"]
    _check_context(tree, sizes["context"])
    experts = (model.get("moe") or {}).get("experts") or 0
    if expert > 1 and experts % expert:
        raise ConfigError("mesh.expert", f"{expert} does not divide model.moe.experts="
                          f"{experts}: each device of the expert axis holds an equal share")
    if expert > 1 and tree["population"]["size"] > 1:
        raise ConfigError("mesh.expert", "not implemented for a population "
                          "(population.size > 1); use mesh.fsdp for the experts")
    if expert > 1 and sizes["context"] > 1:
        raise ConfigError("mesh.expert", "not implemented with mesh.context > 1 (the "
                          "all-to-all dispatch takes whole sequences); use mesh.fsdp for "
                          "the experts")
    dp = data * fsdp * expert
    check_stage(tree, dp)
    if batch % dp:
        raise ConfigError("data.batch_size",
                          f"global batch {batch} is not divisible by the data-parallel size "
                          f"{dp} (mesh.data={data} x mesh.fsdp={fsdp} x mesh.expert={expert})")
    if (batch // dp) % accum:
        raise ConfigError("optim.grad_accum_steps",
                          f"the per-device batch {batch // dp} is not divisible by "
                          f"grad_accum_steps={accum}")
    eval_batch = tree["eval"]["batch_size"] or batch
    if eval_batch % dp:
        raise ConfigError("eval.batch_size",
                          f"{eval_batch} is not divisible by the data-parallel size {dp}")


def _check_context(tree: dict, context: int) -> None:
    """mesh.context > 1 splits the built-in transformer's sequences: what does not take
    part is refused in one line."""
    det = tree["determinism"]["topology_invariant"]
    others = [("model.name", tree["model"]["name"], tree["model"]["name"] != "transformer"),
              ("step.factory", tree["step"]["factory"], bool(tree["step"]["factory"])),
              ("population.size", tree["population"]["size"], tree["population"]["size"] > 1),
              ("determinism.topology_invariant", det, det),
              ("finetune.lora.rank", tree["finetune"]["lora"]["rank"],
               tree["finetune"]["lora"]["rank"] > 0),
              ("model.quant", tree["model"].get("quant", "none"),
               tree["model"].get("quant", "none") != "none"),
              ("mesh.stage", tree["mesh"]["stage"], tree["mesh"]["stage"] > 1)]
    for key, value, on in others:
        if context > 1 and on:
            raise ConfigError("mesh.context", f"{context} splits the built-in transformer's "
                              f"sequences; not implemented with {key}={value!r}: set "
                              "mesh.context=1")


def _check_family(model: dict) -> None:
    """The built-in families' rules beyond one key's type and range."""
    if "dropout" in model and not model["dropout"] < 1.0:
        raise ConfigError("model.dropout", f"expected a number in [0, 1), got "
                                           f"{model['dropout']!r}")
    if model["name"] == "transformer":
        d, h = model["d_model"], model["num_heads"]
        if d % h:
            raise ConfigError("model.num_heads",
                              f"d_model={d} is not divisible by num_heads={h}")
        if (d // h) % 2:
            raise ConfigError("model.num_heads", f"head size d_model/num_heads={d // h} must "
                                                 "be even for rotary positions")
        moe = model.get("moe") or {}
        if moe.get("experts") and not moe["k"] <= moe["experts"]:
            raise ConfigError("model.moe.k", f"expected at most model.moe.experts="
                                             f"{moe['experts']}, got {moe['k']}")
        if moe.get("experts") and not moe["capacity_factor"] > 0:
            raise ConfigError("model.moe.capacity_factor", "expected a number > 0, got "
                                                           f"{moe['capacity_factor']!r}")
    if model["name"] == "user" and ":" not in model["factory"]:
        raise ConfigError("model.factory", "required with model.name='user': "
                          f"'package.module:function', got {model['factory']!r}")
    if model["name"] == "mlp" and model["activation"] not in ACTIVATIONS:
        raise ConfigError("model.activation", f"unknown activation {model['activation']!r}; "
                                              f"choose one of: {', '.join(ACTIVATIONS)}")


def resolve_model(model_cfg) -> ml_collections.ConfigDict:
    """Only the `model` section, defaults filled in and validated (for building a model
    outside a run, e.g. `jtrain.make_model({"name": "mlp", "num_outputs": 3})`)."""
    user = _as_dict(model_cfg)
    name = user.get("name", "transformer")
    _check_value("model.name", str, tuple(MODEL_FAMILIES), name)
    schema = schema_for(name)["model"]
    merged = _build(schema)
    merged["name"] = name
    _overlay(merged, user, schema, prefix="model.")
    _validate_tree(merged, schema, prefix="model.")
    _check_family(merged)
    return ml_collections.ConfigDict(merged)


def _check_data(data: dict) -> None:
    for key in ("source", "transform"):  # import paths; jtrain.data imports them
        path = data[key]
        if path and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", path):
            raise ConfigError(f"data.{key}",
                              f"expected 'package.module:function', got {path!r}")


def config_hash(config) -> str:
    """SHA-256 of the resolved config's canonical JSON."""
    text = json.dumps(_as_dict(config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()
