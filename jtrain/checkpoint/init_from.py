"""`init.path`: start a new run (step 0) from another run's parameters
(docs/guide/checkpoints.md, docs/guide/huggingface.md).

The source is an export (`jtrain export`: params.safetensors or its folder), another
run's checkpoint (its workdir, checkpoints/ or a step folder; the newest intact step, or
`init.step`; nothing there is modified) or `hf:DIR`, a local Hugging Face checkpoint
(llama / arcee into the built-in transformer through jtrain.checkpoint.hf, after a check
of its config.json). Parameters are taken by path, the model's state (BatchNorm
statistics) with them when the source has it, and with `init.opt` the optimizer state
(a checkpoint source only). Leaves are keyed `params/<path>`, `opt_state/...`,
`ema/<path>` here; the user writes the parameter path alone (jtrain.optim.leaf_path).

`init.exclude` (regexes, re.search) keeps matching parameters fresh with their optimizer
state and average; a regex matching nothing is a ConfigError (one written for the old
`params/...` paths is read without the prefix, with a note). A missing leaf or another
shape is an error naming the leaf (exit 3); another floating dtype is cast, and said so;
LoRA adapters the source lacks keep their fresh init. A weight EMA takes the source's
average, or starts at the loaded parameters. `init.map` renames the source's tensors to
the model's paths ((regex, replacement) pairs; a trailing `.T` transposes a torch Linear
weight), their optimizer state and average following. `init.into = NAME` loads the
source into one sub-tree of the state (a step of your own: `teacher`), paths, excludes
and the mapping relative to it; `init.into = "A,B"` loads it into several sub-trees
of one structure (DPO's policy and its frozen reference). One line reports what was
loaded, excluded and unused.
"""

from __future__ import annotations

import os
import re

import jax

from jtrain import optim
from jtrain import state as state_lib
from jtrain.checkpoint import export as export_lib
from jtrain.checkpoint import hf
from jtrain.checkpoint import integrity, store
from jtrain.errors import ConfigError, ExportError, RestoreError
from jtrain.models import lora
from jtrain.observe.console import say


def init_from(init_cfg, abstract_state, init_fn):
    """(state, origin): `origin` is the header's start-up line, `initialized from PATH
    (step S, K leaves, E excluded)`. A run or an export in a bucket (s3://, gs://) is read
    from a staging copy (its committed steps only)."""
    uri = init_cfg.path
    if not store.is_remote(uri):
        return _init_from(init_cfg, uri, abstract_state, init_fn)
    with store.local_copy(uri, say=say) as local:
        state, origin = _init_from(init_cfg, local, abstract_state, init_fn, shown=uri)
    return state, origin


def _init_from(init_cfg, path: str, abstract_state, init_fn, shown: str | None = None):
    from_hf = path.startswith(hf.HF_PREFIX)
    local = path[len(hf.HF_PREFIX):] if from_hf else path
    if not os.path.exists(local):
        raise ConfigError("init.path", f"{local}: no such file or directory")
    with_opt = init_cfg.opt
    names = [n.strip("/") for n in (init_cfg.get("into") or "").split(",")]
    into = names[0]
    spec = integrity.tree_spec(abstract_state)
    target = _inside(spec, into, with_opt)
    if any(_inside(spec, n, with_opt) != target for n in names[1:]):
        raise ConfigError("init.into", f"{', '.join(names)}: sub-trees of different "
                          "structures; one source fills sub-trees of one structure")
    params = [p[len(_PARAMS):] for p in target if p.startswith(_PARAMS)]
    # Checked before anything is read: a pattern that excludes nothing is a config error.
    excludes = [re.compile(p) for p in _param_patterns(
        "init.exclude", init_cfg.exclude, params)]
    try:
        if from_hf:
            loaded, source, source_step = _load_hf(init_cfg, local, target, excludes)
        else:
            loaded, source, source_step = _load(init_cfg, path,
                                                abstract_state.ema is not None,
                                                {p[len(_MODEL_STATE):] for p in target
                                                 if p.startswith(_MODEL_STATE)})
            source = shown or source
    except ExportError as e:
        raise RestoreError(f"init.path: {e}") from None

    fresh = init_fn()
    wanted = [p for p in target if p.startswith((_PARAMS, _MODEL_STATE))
              or (with_opt and p.startswith("opt_state/"))]
    taken, excluded, adapters, cast = _take(wanted, loaded, target, excludes, set(params),
                                            source)
    # A source without the model's state (Hugging Face weights, a safetensors file of
    # parameters alone) leaves the statistics at their fresh init: said below.
    no_state = [p for p in wanted if p.startswith(_MODEL_STATE) and p not in loaded
                and p not in excluded]
    if into:  # back to the whole state's paths
        taken = {f"{_PARAMS}{n}/{p[len(_PARAMS):]}": a for p, a in taken.items()
                 for n in names}

    def pick(kp, leaf):
        arr = taken.get(integrity.leaf_path(kp))
        if arr is None:
            return leaf
        arr = arr.astype(leaf.dtype)
        return jax.make_array_from_callback(arr.shape, leaf.sharding, lambda idx: arr[idx])

    state = jax.tree_util.tree_map_with_path(pick, fresh)
    if state.ema is not None:
        state = state.replace(ema=_ema_from(loaded, taken, state))
    unused = sorted(p for p in loaded if p not in target)
    say(f"initialized from {source}: {len(taken)} leaves"
        + (" (params and optimizer state)" if with_opt else " (params)")
        + (f", {len(excluded)} excluded (fresh init: {_first(excluded)})" if excluded else "")
        + (f", {len(adapters)} LoRA adapter leaves not in the source (fresh init: "
           f"{_first(adapters)})" if adapters else "")
        + (f", cast {', '.join(sorted(cast))}" if cast else "")
        + (f", {len(no_state)} model state leaves not in the source (fresh init: "
           f"{_first(no_state)})" if no_state else "")
        + (f", {len(unused)} source leaves unused ({_first(unused)})" if unused else "")
        + ("; the source's LoRA adapters are not used: export it with --merge_lora"
           if any(lora.is_adapter(p) for p in unused) else "")
        + "; starting at step 0")
    origin = (f"initialized {','.join(names) + ' ' if into else ''}from {shown or path} ("
              + ("Hugging Face weights" if from_hf else f"step {source_step}")
              + f", {len(taken)} leaves, "
              f"{len(excluded)} excluded)")
    return state, origin


def _inside(target: dict, into: str, with_opt: bool) -> dict:
    """`target` (leaf path -> spec), or with init.into = NAME the parameters
    under NAME/ as if they were the whole model's (a step of your own: a teacher's
    sub-tree); everything else keeps its fresh init."""
    if not into:
        return target
    if with_opt:
        raise ConfigError("init.opt", "loads an optimizer state for the "
                          "whole model; with init.into the source goes into one "
                          "sub-tree (parameters only)")
    inside = f"{_PARAMS}{into}/"
    view = {_PARAMS + p[len(inside):]: spec for p, spec in target.items()
            if p.startswith(inside)}
    if not view:
        tops = sorted({p[len(_PARAMS):].split("/", 1)[0] for p in target
                       if p.startswith(_PARAMS)})
        raise ConfigError("init.into", f"{into!r} names no part of the state; "
                          f"its top-level names: {', '.join(tops[:12])}")
    return view


def _load(init_cfg, path: str, with_ema: bool, state_names: set):
    """(leaves as "params/<path>", "opt_state/...", "ema/<path>", "model_state/<name>",
    source, step) of the export or run at `path`, parameters renamed by
    init.map. `state_names`: the model's state leaves (BatchNorm statistics)
    by the names an export gives them (`bn/mean`, `batch_stats/bn/mean`): an export holds
    them beside the parameters, a run under model_state/."""
    with_opt = init_cfg.opt
    if export_lib.is_export(path):
        if with_opt:
            raise RestoreError(f"init.path={path} is an export (parameters "
                               "only); init.opt needs a checkpoint")
        if init_cfg.step not in ("", "latest"):
            raise RestoreError(f"init.path={path} is an export (one step); "
                               "init.step applies to a run")
        file = (path if path.endswith(".safetensors")
                else os.path.join(path, export_lib.PARAMS_FILE))
        tensors, metadata = export_lib.read_safetensors(file)
        state = {f"{_MODEL_STATE}{k}": v for k, v in tensors.items() if k in state_names}
        loaded = {f"{_PARAMS}{k}": v for k, v in tensors.items() if k not in state_names}
        source, source_step = path, metadata.get("step", "?")
    else:
        source = export_lib.find_step_dir(path, init_cfg.step)
        source_step = os.path.basename(os.path.normpath(source))
        prefixes = ("params", "opt_state") if with_opt else ("params",)
        if with_ema:
            prefixes += ("ema",)
        if state_names:
            prefixes += ("model_state",)
        loaded = export_lib.load_checkpoint_leaves(source, prefixes)
        state = {k: v for k, v in loaded.items() if k.startswith(_MODEL_STATE)}
        loaded = {k: v for k, v in loaded.items() if k not in state}
    init_map = init_cfg.get("map") or ()
    loaded = _renamed(loaded, init_map) if init_map else loaded
    return {**loaded, **state}, source, source_step


def _take(wanted, loaded: dict, target: dict, excludes, params: set, source: str):
    """(taken {leaf: array}, excluded, fresh LoRA adapters, casts) of the `wanted` leaves;
    a leaf the source lacks or holds in another shape is a RestoreError naming it."""
    taken, excluded, adapters, cast = {}, [], [], set()
    for p in wanted:
        param = _param_of(p, params)
        if param is not None and any(rx.search(param) for rx in excludes):
            excluded.append(p)
            continue
        if p not in loaded and p.startswith(_PARAMS) and lora.is_adapter(p):
            adapters.append(p)  # a LoRA fine-tune of a plain model: fresh adapters
            continue
        if p not in loaded and p.startswith(_MODEL_STATE):
            continue  # fresh statistics, reported by the caller
        if p not in loaded:
            raise RestoreError(f"init.path {source}: {_shown(p)} "
                               f"({tuple(target[p][0])} {target[p][1]}) is not in the "
                               "source; exclude it with init.exclude to keep "
                               "its fresh init")
        arr = loaded[p]
        shape, dtype = target[p]
        if list(arr.shape) != list(shape):
            raise RestoreError(f"init.path {source}: {_shown(p)}: source has "
                               f"{tuple(arr.shape)} {arr.dtype.name}, the model "
                               f"{tuple(shape)} {dtype}; exclude it with "
                               "init.exclude")
        if arr.dtype.name != dtype:
            floats = all(n.startswith(("float", "bfloat")) for n in (arr.dtype.name, dtype))
            if not floats:
                raise RestoreError(f"init.path {source}: {_shown(p)}: source "
                                   f"dtype {arr.dtype.name}, the model {dtype}")
            cast.add(f"{arr.dtype.name}->{dtype}")
        taken[p] = arr
    return taken, excluded, adapters, cast


def _load_hf(init_cfg, directory: str, target: dict, excludes):
    """(leaves as "params/<path>", source, step "hf") of a Hugging Face checkpoint."""
    where = f"hf:{directory}"
    if init_cfg.opt:
        raise RestoreError(f"init.path={where} holds parameters only; init.opt "
                           "needs a jtrain checkpoint")
    if init_cfg.step not in ("", "latest"):
        raise RestoreError(f"init.path={where} is one set of weights; "
                           "init.step applies to a run")
    config, tensors = hf.read_dir(directory)
    init_map = init_cfg.get("map") or ()
    if init_map:
        return _renamed(tensors, init_map), where, "hf"
    params = {p[len(_PARAMS):]: spec[0] for p, spec in target.items()
              if p.startswith(_PARAMS)}
    if hf.layout(params) is None:
        raise ConfigError("init.map", f"required to load hf:{directory} into a "
                          "model other than the built-in transformer: (regex, "
                          "replacement) pairs from its tensor names to your leaf paths")
    hf.check_config(config, where, params)
    skip = {p for p in params if any(rx.search(p) for rx in excludes)}
    return hf.from_hf(tensors, params, where, skip), where, "hf"


def _ema_from(loaded: dict, taken: dict, state):
    """The weight EMA of a run started from a source: the source's average of each
    parameter taken from it, else the (loaded or fresh) parameter itself."""
    shardings = jax.tree.map(lambda x: x.sharding, state.ema)
    start = jax.jit(state_lib.ema_init, out_shardings=shardings)(state.params)

    def pick(kp, leaf):
        rel = integrity.leaf_path(kp)
        arr = loaded.get(f"ema/{rel}") if f"params/{rel}" in taken else None
        if arr is None or list(arr.shape) != list(leaf.shape):
            return leaf
        arr = arr.astype(leaf.dtype)
        return jax.make_array_from_callback(arr.shape, leaf.sharding, lambda idx: arr[idx])

    return jax.tree_util.tree_map_with_path(pick, start)


def _first(paths: list, n: int = 3) -> str:
    return ", ".join(map(_shown, paths[:n])) + (", ..." if len(paths) > n else "")


_PARAMS = "params/"
_MODEL_STATE = "model_state/"
_OLD_PREFIX = re.compile(r"^\^?params/")  # how patterns were written for these keys once


def _shown(key: str) -> str:
    """A leaf as the user writes it: a parameter by its path, other leaves in full."""
    return key[len(_PARAMS):] if key.startswith(_PARAMS) else key


def _param_of(key: str, params: set) -> str | None:
    """The parameter path a state leaf belongs to: `params/X` and `ema/X` are X, an
    optimizer state leaf (`opt_state/.../mu/X`) the longest parameter path it ends with;
    None for a leaf of no parameter (the optimizer's step count)."""
    head, _, rest = key.partition("/")
    if head in ("params", "ema", "model_state"):  # a model state leaf: by its own path
        return rest
    parts = rest.split("/")
    return next((tail for i in range(len(parts))
                 if (tail := "/".join(parts[i:])) in params), None)


def _param_patterns(key: str, patterns, names, what: str = "parameter path",
                    like: str = "paths") -> list[str]:
    """`patterns` as matched against the parameter paths `names`: each must match one;
    a pattern written for the old `params/...` paths that matches nothing as written is
    read without the prefix (anchored, which it was: every path began with it)."""
    out = []
    for pattern in patterns:
        if _OLD_PREFIX.match(pattern) and not any(re.search(pattern, n) for n in names):
            new = "^" + _OLD_PREFIX.sub("", pattern, count=1)
            say(f"note: {key}: {pattern!r} is read as {new!r}; parameter patterns are "
                "written without 'params/' (docs/guide/user-models.md, Parameter paths)")
            pattern = new
        out.append(pattern)
    optim.check_patterns(key, out, names, what, like)
    return out


def _renamed(loaded: dict, init_map) -> dict:
    """init.map applied to the source's parameters (each regex must match one
    of their names: a Hugging Face tensor name, or a run's parameter path)."""
    names = hf.source_params(loaded)
    pairs = [(_param_patterns("init.map", [pattern], names,
                              "parameter name in the source", "names")[0], replacement)
             for pattern, replacement in hf.parse_map(init_map, compiled=False)]
    return hf.rename(loaded, hf.parse_map(pairs))
