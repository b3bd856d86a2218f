"""Export a checkpoint's parameters: `export(workdir, out, ...)`, the library side of
`jtrain export` (docs/reference/commands.md; docs/guide/checkpoints.md).

Writes `DIR/params.safetensors` (parameters only, named by their paths, e.g.
`blocks_0/attn/qkv/kernel`: a JSON header plus raw little-endian bytes, loadable without
jtrain or pickle, `jtrain.checkpoint.tensorfile`) and `DIR/export.json` (step, source,
dtype, parameter count, the run's config); `init.path=DIR` starts a run from it.
`--dtype=bfloat16` casts floating parameters; `--merge_lora` folds each adapter pair
into its weight (`W + alpha/rank * A @ B`, jtrain.models.lora.merge) for the plain
model, a usage error (exit 2) without LoRA; `--weights=ema` writes the weight EMA under
the params' names and dtypes. The checkpoint is integrity-checked before reading;
errors are one line `jtrain: export error: ...`, exit 3.
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np

from jtrain.checkpoint import integrity, policy
from jtrain.checkpoint.tensorfile import np_dtype as _np_dtype
from jtrain.checkpoint.tensorfile import read_safetensors, write_safetensors
from jtrain.errors import ExportError, UsageError
from jtrain.observe import layout, runfiles

PARAMS_FILE = "params.safetensors"
INFO_FILE = "export.json"
# read_safetensors and write_safetensors are this module's names too (older callers).
__all__ = ["export", "find_step_dir", "load_export", "read_safetensors",
           "write_safetensors"]


def is_export(path: str) -> bool:
    return os.path.isfile(path if path.endswith(".safetensors")
                          else os.path.join(path, PARAMS_FILE))


def load_export(path: str) -> dict[str, np.ndarray]:
    """{"params/<path>": array} from an export directory or its .safetensors file."""
    file = path if path.endswith(".safetensors") else os.path.join(path, PARAMS_FILE)
    tensors, _ = read_safetensors(file)
    return {f"params/{k}": v for k, v in tensors.items()}


def find_step_dir(path: str, step: int | str | None = None) -> str:
    """The intact step directory of a jtrain run: `path` is a workdir, its
    `checkpoints/` directory or a step directory; `step` None / "latest" (the newest
    intact one), N, or "best" (by the run's checkpoint.monitor as logged in its
    metrics.jsonl; `path` must then be the workdir or its checkpoints/). Reads only."""
    if isinstance(step, str):
        step = _named_step(path, step)
    if os.path.isfile(os.path.join(path, integrity.MANIFEST)):
        number = integrity.parse_step(os.path.basename(os.path.normpath(path)))
        if number is None:
            raise ExportError(path, "a checkpoint whose folder name is not a step number")
        problem = integrity.check_step(path, number)
        if problem:
            raise ExportError(f"damaged checkpoint: {problem}")
        return path
    ckpts = os.path.join(path, "checkpoints")
    directory = ckpts if os.path.isdir(ckpts) else path
    if not os.path.isdir(directory):
        raise ExportError(f"{path}: no such directory")
    steps, _, _ = integrity.scan(directory)
    if step is not None:
        if step not in steps:
            raise ExportError(f"{directory}: no checkpoint for step {step} (have: "
                              f"{', '.join(map(str, steps)) or 'none'})")
        steps = [step]
    problems = []
    for s in reversed(steps):
        problem = integrity.check_step(os.path.join(directory, str(s)), s)
        if problem is None:
            return os.path.join(directory, str(s))
        problems.append(problem)
    raise ExportError(f"damaged checkpoint: {problems[0]}" if problems
                      else f"{directory}: no checkpoints")


def _named_step(path: str, step: str) -> int | None:
    if step in ("", "latest"):
        return None
    if integrity.parse_step(step) is not None:
        return integrity.parse_step(step)
    if step != "best":
        raise ExportError(f"step: expected a step number, 'latest' or 'best', got {step!r}")
    norm = os.path.normpath(path)
    workdir = norm if os.path.isdir(os.path.join(norm, "checkpoints")) else (
        os.path.dirname(norm) if os.path.basename(norm) == "checkpoints" else None)
    if workdir is None or not os.path.isfile(os.path.join(workdir, "config.json")):
        raise ExportError(f"{path}: step 'best' needs a run's workdir (with config.json and "
                          "metrics.jsonl)")
    cfg_path = os.path.join(workdir, "config.json")
    ckpt = runfiles.read_object(cfg_path, error=ExportError).get("checkpoint") or {}
    problem = (runfiles.check_fields({"checkpoint": ckpt}, {"checkpoint": dict})
               or runfiles.check_fields(ckpt, {k: str for k in ("monitor", "mode")
                                               if ckpt.get(k) is not None}))
    if problem is not None:
        raise ExportError(cfg_path, problem if problem.startswith("checkpoint")
                          else f"checkpoint.{problem}")
    monitor, mode = ckpt.get("monitor") or "eval/loss", ckpt.get("mode") or "min"
    steps, _, _ = integrity.scan(os.path.join(workdir, "checkpoints"))
    best = policy.best_logged_step(workdir, steps, monitor, mode)
    if best is None:
        raise ExportError(f"{path}: step 'best': no checkpoint of {steps} has a logged "
                          f"{monitor} in metrics.jsonl")
    return best


def load_checkpoint_leaves(step_dir: str, prefixes=("params",)) -> dict[str, np.ndarray]:
    """{"params/<path>": array, ...} of a saved TrainState's top-level fields in
    `prefixes`, as host numpy arrays (any device count; partial read)."""
    import jax
    import orbax.checkpoint as ocp

    # orbax reads metadata only through absolute paths (a relative one gives None).
    path = os.path.join(os.path.abspath(step_dir), "state")
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)  # "Metadata file does not exist" noise
    try:
        ck = ocp.PyTreeCheckpointer()
        tree = ck.metadata(path).item_metadata.tree
        sub = {k: tree[k] for k in prefixes if k in tree}
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), sub)
        out = ck.restore(path, args=ocp.args.PyTreeRestore(item=sub, restore_args=args,
                                                           partial_restore=True))
    finally:
        absl_logger.setLevel(level)
    return {integrity.leaf_path(p): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(out)[0]}


def export(workdir: str, out: str, *, step: int | str | None = None,
           dtype: str | None = None, merge_lora: bool = False,
           weights: str = "params", member: int | None = None, writer=None,
           subtree: str | None = None, check=None) -> dict:
    """Write the export; returns the export.json record. `merge_lora`: adapters folded
    into their weights (a UsageError for a run without LoRA). `weights="ema"`: the
    weight EMA is written as the params (a UsageError for a run without one). `member`:
    member i of a population run (population.size > 1), written as a plain run's export
    (its config records that member's seed and values, population off).
    `writer(out, tensors, config) -> dict`: writes the tensors instead of
    params.safetensors (jtrain.checkpoint.hf_export.export: a Hugging Face directory);
    what it returns is the record's "hf" entry; `check(config)` refuses a run's config
    before anything is written. `subtree`: one named part of the state
    (a step of your own keeps several models in it: "g" for the generator, "student"),
    written under names relative to it, as a plain run's export."""
    if weights not in ("params", "ema"):
        raise UsageError(f"--weights: expected params or ema, got {weights!r}")
    step_dir = find_step_dir(workdir, step)
    check_out(out, os.path.dirname(os.path.dirname(os.path.abspath(step_dir))))
    control = runfiles.read_object(os.path.join(step_dir, "control", "metadata"),
                                   error=ExportError)
    from jtrain.optim import SCHEDULE_FREE

    optimizer = ((control.get("config") or {}).get("optim") or {}).get("name")
    averaged = optimizer in SCHEDULE_FREE and weights == "params"
    loaded = load_checkpoint_leaves(step_dir, ("params", "model_state", "ema")
                                    if weights == "ema" else
                                    ("params", "model_state", "opt_state") if averaged
                                    else ("params", "model_state"))
    config, loaded = _member_of(control.get("config") or {}, loaded, member, workdir)
    if check is not None:
        check(config)
    leaves = {name.split("/", 1)[1]: arr  # "params/body/kernel" -> "body/kernel"
              for name, arr in loaded.items() if name.startswith("params/")}
    if weights == "ema":
        leaves = _ema_as_params(loaded, leaves, workdir)
    if averaged:  # what the optimizer evaluates at, as training and jtrain evaluate do
        leaves = _schedule_free_average(loaded, leaves, step_dir)
    merged = _merge_lora(leaves, config, workdir) if merge_lora else None
    model_state = _model_state(loaded, leaves, workdir)
    leaves = {**leaves, **model_state}
    if subtree:
        leaves = _subtree(leaves, subtree, workdir)
        model_state = {}
    tensors = {}
    for name, arr in leaves.items():
        floating = np.issubdtype(arr.dtype, np.floating) or arr.dtype.name == "bfloat16"
        if dtype and floating:
            arr = arr.astype(_np_dtype(dtype))
        tensors[name] = arr
    os.makedirs(out, exist_ok=True)
    record = {
        "format": "jtrain-export", "version": 1,
        "step": int(os.path.basename(step_dir)), "source": os.path.abspath(step_dir),
        "dtype": dtype or "as saved", "weights": weights, "num_tensors": len(tensors),
        "num_params": int(sum(a.size for n, a in tensors.items() if n not in model_state)),
        "config_sha256": control.get("config_sha256"), "config": config,
    }
    if model_state:
        record["model_state"] = sorted(model_state)
    if subtree:
        record["subtree"] = subtree.strip("/")
    if member is not None:
        record["member"] = member
    if averaged:
        record["schedule_free_average"] = True
    if merged is not None:
        record["merged_lora"] = merged
    if writer is not None:
        record["hf"] = writer(out, tensors, config or {})
    else:
        write_safetensors(os.path.join(out, PARAMS_FILE), tensors,
                          {"format": "jtrain-export", "step": str(record["step"])})
    layout.write_file(os.path.join(out, INFO_FILE), json.dumps(record, indent=2,
                                                               sort_keys=True))
    return record


def check_out(out: str, run: str) -> None:
    """A UsageError unless `out` may receive an export of the run in `run`: not the run's
    workdir nor a folder inside it, and not a non-empty folder holding another run."""
    real_out, real_run = os.path.realpath(out), os.path.realpath(run)
    if real_out == real_run or real_out.startswith(real_run.rstrip(os.sep) + os.sep):
        raise UsageError("--out", f"{out} is inside the run's workdir {run}; export to a "
                         "folder outside it")
    if os.path.isdir(out) and any(os.path.lexists(os.path.join(out, name))
                                  for name in ("checkpoints", "metrics.jsonl", "run.json")):
        raise UsageError("--out", f"{out} holds a run (checkpoints/, metrics.jsonl or "
                         "run.json); export to a new or empty folder")


def _schedule_free_average(loaded: dict, params: dict, step_dir: str) -> dict:
    """A schedule-free run's evaluation params, x = (y - (1 - b1) z) / b1 from the saved
    step's params y and the optimizer state's z and b1 (optax.contrib's
    schedule_free_eval_params); leaves without a z (frozen) are exported as they are."""
    state = {name: arr for name, arr in loaded.items() if name.startswith("opt_state/")}
    b1 = [arr for name, arr in state.items() if name.endswith("/b1")]
    z = {name.split("/z/", 1)[1]: arr for name, arr in state.items() if "/z/" in name}
    if len(b1) != 1 or not z:
        raise ExportError(f"{step_dir}: a schedule-free run whose optimizer state has no "
                          "single b1 and z; export it from a checkpoint jtrain wrote")
    b1 = np.float32(b1[0])
    return {name: arr if name not in z else ((arr - (np.float32(1.0) - b1) * z[name]) / b1)
            .astype(arr.dtype) for name, arr in params.items()}


def _subtree(leaves: dict, subtree: str, workdir: str) -> dict:
    """The leaves under `subtree` (a "/"-separated path of the state), renamed relative
    to it; an ExportError listing the top-level names when nothing is there."""
    prefix = subtree.strip("/") + "/"
    taken = {name[len(prefix):]: arr for name, arr in leaves.items()
             if name.startswith(prefix)}
    if not taken:
        tops = sorted({name.split("/", 1)[0] for name in leaves})
        raise ExportError(f"--subtree={subtree}: {workdir}'s state has nothing there; its "
                          f"top-level names: {', '.join(tops[:12])}")
    return taken


def _model_state(loaded: dict, params: dict, workdir: str) -> dict:
    """The model's state beyond parameters (BatchNorm's running statistics), named as
    the model names it: a Linen collection's path (`batch_stats/BatchNorm_0/mean`), an NNX
    variable's (`bn/mean`)."""
    state = {name.split("/", 1)[1]: arr for name, arr in loaded.items()
             if name.startswith("model_state/")}
    clash = sorted(set(state) & set(params))
    if clash:
        raise ExportError(f"{workdir}: the model's state and its parameters both name "
                          f"{clash[0]!r}; rename one of them in the model")
    return state


def _ema_as_params(loaded: dict, params: dict, workdir: str) -> dict:
    """The checkpoint's weight EMA under the params' names, in their dtypes."""
    ema = {name.split("/", 1)[1]: arr for name, arr in loaded.items()
           if name.startswith("ema/")}
    if not ema:
        raise UsageError(f"--weights=ema: {workdir} keeps no weight EMA (optim.ema.decay "
                         "= 0); export it without --weights=ema")
    return {name: ema[name].astype(arr.dtype) for name, arr in params.items()}


def _merge_lora(leaves: dict, config: dict, workdir: str) -> dict:
    """Folds the LoRA adapters in `leaves` into their weights (in place); returns
    {"rank", "alpha", "merged": number of weights}."""
    from jtrain.models import lora

    lora_cfg = (config.get("finetune") or {}).get("lora") or {}
    rank = int(lora_cfg.get("rank") or 0)
    if rank <= 0 or not any(lora.is_adapter(name) for name in leaves):
        raise UsageError(f"--merge_lora: {workdir} was not trained with LoRA "
                         f"(finetune.lora.rank={rank}); export it without --merge_lora")
    alpha = float(lora_cfg["alpha"])
    try:
        merged, names = lora.merge(leaves, rank, alpha)
    except ValueError as e:
        raise ExportError(f"--merge_lora: {e}") from None
    leaves.clear()
    leaves.update(merged)
    return {"rank": rank, "alpha": alpha, "merged": len(names)}


def _member_of(config: dict, loaded: dict, member: int | None, workdir: str):
    """(config, leaves) of population member `member`: its slice of every leaf and a
    config that trains it alone; unchanged for a plain run without `member`."""
    from jtrain.config import schema_population

    size = int((config.get("population") or {}).get("size", 1))
    if member is None:
        if size > 1:
            raise UsageError(f"{workdir} trained a population of {size} members: pass "
                             f"--member=0..{size - 1} (summary.json names the best)")
        return config, loaded
    if size == 1:
        raise UsageError(f"--member={member}: {workdir} is not a population run "
                         "(population.size = 1); export it without --member")
    if not 0 <= member < size:
        raise UsageError(f"--member={member}: the population has members 0..{size - 1}")
    plain = json.loads(json.dumps(config))
    for key, value in schema_population.member_values(config, member).items():
        node = plain
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    plain["population"] = {**plain["population"], "size": 1, "seeds": [], "vary": {}}
    return plain, {name: arr[member] for name, arr in loaded.items()}
