"""The eval loop, and `python -m jtrain.evaluate`: evaluate a checkpoint, write a report.

Eval batches are padded with a validity mask (`jtrain.data.eval_batches`), so every
example counts once and the eval step compiles once. The step returns one batch's metric
states (`jtrain.metrics`, float32 sums on device); they come back a few batches behind
(`MAX_IN_FLIGHT`) and are merged on the host in float64, so the result does not depend on
how the examples were split into batches, devices or processes. Host-side metrics (AUROC,
Spearman) receive this process's rows of each batch and are gathered across processes
once at the end.

    python -m jtrain.evaluate --workdir=runs/base [--step=N|best|latest]
                              [--data=eval|train|FILE.npz] [--num_batches=N] [--no_plots]

writes WORKDIR/eval_<step>.json (every metric, the confusion matrix for classification)
and PNGs beside it: eval_<step>_curves.png (training curves from metrics.jsonl) and
eval_<step>_confusion.png. `best` is the checkpoint with the lowest eval/loss logged.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections import deque

import jax
import numpy as np

from jtrain import data as data_lib
from jtrain import mesh as mesh_lib
from jtrain import metrics as metrics_lib

MAX_IN_FLIGHT = 8


@dataclasses.dataclass
class Evaluation:
    scalars: dict[str, float]         # "eval/<name>": value
    arrays: dict[str, np.ndarray]     # "confusion_matrix": int64 [C, C] (true, predicted)
    num_examples: int


def make_spec(eval_cfg, apply_fn, abstract_params, sample_inputs, example: dict, *,
              byte_level: bool = False, with_defaults: bool = False) -> metrics_lib.EvalSpec:
    """The metrics to compute (`eval.metrics`, or the task's defaults when empty; both with
    `with_defaults`), from the model's output shape (no arrays are built) and one
    example's targets."""
    out = jax.eval_shape(lambda p, x: apply_fn(p, x, rng=None, train=False),
                         abstract_params, sample_inputs)
    output_shape = tuple(out.shape[1:]) if hasattr(out, "shape") else None
    targets = np.asarray(example["targets"])
    names = tuple(eval_cfg.metrics)
    if with_defaults or not names:
        task, num_classes = metrics_lib.infer_task(output_shape, targets.shape, targets.dtype)
        names = tuple(dict.fromkeys(metrics_lib.default_names(
            task, num_classes, top_k=eval_cfg.top_k, byte_level=byte_level) + names))
    return metrics_lib.EvalSpec.create(output_shape, targets.shape, targets.dtype, names=names,
                                       top_k=eval_cfg.top_k, max_gathered=eval_cfg.max_gathered,
                                       byte_level=byte_level)


def local_rows(x) -> np.ndarray:
    """This process's rows of a batch-sharded global array, in order (replicas once)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    blocks = {}
    for shard in x.addressable_shards:
        start = shard.index[0].start or 0
        if start not in blocks:
            blocks[start] = np.asarray(shard.data)
    return np.concatenate([blocks[k] for k in sorted(blocks)])


def run_eval(eval_step, params, source, *, mesh, local_batch: int, spec, max_batches: int = 0
             ) -> Evaluation:
    """Metrics over every example of `source` (or the first `max_batches` global batches).

    `eval_step` = jit(jtrain.step.make_eval_step(..., metrics=spec)). A collective on
    several processes: every process calls it with its own `local_batch` rows."""
    device_total, host_total = metrics_lib.make_collection(spec).partition()
    pending: deque = deque()

    def drain(out):
        nonlocal device_total, host_total
        state, inputs = out
        device_total = device_total.merge(state)  # float64 / int64 on the host
        if host_total.metrics:
            host_total = host_total.update(**{k: local_rows(v) for k, v in inputs.items()})

    batches = data_lib.eval_batches(
        source, local_batch=local_batch, process_index=jax.process_index(),
        process_count=jax.process_count(), max_batches=max_batches)
    for batch in batches:
        pending.append(eval_step(params, mesh_lib.host_to_device(batch, mesh)))
        if len(pending) > MAX_IN_FLIGHT:
            drain(pending.popleft())
    while pending:
        drain(pending.popleft())
    # The device states came from global batches and already cover every process; the
    # host-side buffers hold this process's rows only.
    host_total = metrics_lib.reduce_across_processes(host_total)
    scalars = {**device_total.compute(), **host_total.compute()}
    n = data_lib.num_eval_examples(source, max_batches, local_batch * jax.process_count())
    return Evaluation(scalars={f"eval/{k}": v for k, v in scalars.items()},
                      arrays=device_total.compute_arrays(), num_examples=n)


def headline(scalars: dict) -> str:
    """`loss 1.2340, accuracy 0.6120, ...` for the console: per-class values and the micro
    averages (equal to the accuracy for single-label classes) are left to the files."""
    return ", ".join(f"{k.split('/', 1)[1]} {v:.4f}" for k, v in scalars.items()
                     if k.startswith("eval/") and k.count("/") == 1
                     and not k.endswith("_micro") and isinstance(v, float))


def format_line(step: int, result: Evaluation) -> str:
    """`jtrain: eval at step 500 (925 examples): loss 1.2340, accuracy 0.6120, ...`."""
    return (f"jtrain: eval at step {step} ({result.num_examples:,} examples): "
            + headline(result.scalars))


# ----------------------------------------------------------------------------------------
# The command: evaluate a checkpoint of a finished or running workdir


def evaluate_checkpoint(workdir: str, *, step: str | int = "latest", data: str = "eval",
                        num_batches: int = 0, plots: bool = True) -> dict:
    """Evaluates a checkpoint of a run with a built-in model and writes the report files.

    Returns the report (what eval_<step>.json holds)."""
    from jtrain import checkpoint
    from jtrain.models import adapters
    from jtrain import config as config_lib
    from jtrain import models as models_lib
    from jtrain import optim as optim_lib
    from jtrain import precision as precision_lib
    from jtrain import state as state_lib
    from jtrain import step as step_lib
    from jtrain import losses

    workdir = os.path.abspath(workdir)
    cfg_path = os.path.join(workdir, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"--workdir: {workdir} has no config.json (not a jtrain run)")
    with open(cfg_path) as f:
        cfg = config_lib.resolve(json.load(f))
    config_lib.validate(cfg, num_devices=jax.device_count())
    reader = checkpoint.CheckpointReader(workdir)  # read-only: safe beside a running job
    ckpt_cfg = cfg.checkpoint.to_dict()
    chosen = resolve_step(step, reader.all_steps(), workdir,
                          monitor=cfg.checkpoint.monitor,
                          mode=cfg.checkpoint.mode)
    mesh = mesh_lib.make_mesh(cfg.mesh)
    policy = precision_lib.make_policy(cfg.model)
    source, data_name, data_info = _pick_data(data, cfg.data)
    model_fns = adapters.to_model_fns(models_lib.make_model(
        cfg.model, dtype=policy.compute_dtype, param_dtype=policy.param_dtype))
    tx, _ = optim_lib.make_optimizer(cfg.optim, cfg.total_steps)
    sample = np.asarray(source[0]["inputs"])
    sample_inputs = jax.ShapeDtypeStruct((cfg.data.batch_size,) + sample.shape, sample.dtype)
    abstract, shardings = state_lib.make_abstract_state(
        model_fns, tx, policy, sample_inputs, mesh, cfg.seed)
    state = reader.restore(chosen, checkpoint.abstract_with_shardings(abstract, shardings))[0]

    byte_level = data_info.get("name") == "pystdlib"
    spec = make_spec(cfg.eval, model_fns.apply, abstract.params, sample_inputs, source[0],
                     byte_level=byte_level, with_defaults=True)
    eval_step = jax.jit(
        step_lib.make_eval_step(model_fns.apply, losses.default_loss, user_loss=False,
                                metrics=spec),
        in_shardings=(shardings.params, mesh_lib.batch_sharding(mesh)),
        out_shardings=(mesh_lib.replicated(mesh), mesh_lib.batch_sharding(mesh)))
    eval_batch = (cfg.eval.batch_size or cfg.data.batch_size) // jax.process_count()
    from flax import linen as nn

    with jax.set_mesh(mesh), nn.logical_axis_rules(mesh_lib.LOGICAL_RULES):
        result = run_eval(eval_step, state.params, source, mesh=mesh, local_batch=eval_batch,
                          spec=spec, max_batches=num_batches)
    report = {
        "step": chosen, "data": data_name, "task": spec.task,
        "num_examples": result.num_examples,
        "metrics": {k: _json_number(v) for k, v in result.scalars.items()},
        **{k: v.tolist() for k, v in result.arrays.items()},
    }
    if jax.process_index() == 0:
        files = write_report(workdir, report, result, plots=plots)
        report["files"] = files
    return report


def resolve_step(step, available: list[int], workdir: str, *, monitor: str = "eval/loss",
                 mode: str = "min") -> int:
    """`latest`, N, or `best`: the checkpoint whose `monitor` value logged in metrics.jsonl
    is lowest (mode min) or highest (max): checkpoint.monitor / checkpoint.mode."""
    if not available:
        raise FileNotFoundError(f"--workdir: {workdir} has no finished checkpoints")
    if step in (None, "", "latest"):
        return max(available)
    if step == "best":
        values = {}
        for record in read_jsonl(os.path.join(workdir, "metrics.jsonl")):
            if isinstance(record.get(monitor), (int, float)):
                values[int(record["step"])] = float(record[monitor])
        scored = [(values[s] if mode == "min" else -values[s], s) for s in available
                  if s in values and math.isfinite(values[s])]
        if not scored:
            raise ValueError(f"--step=best: no checkpoint step of {available} has a logged "
                             f"{monitor} in metrics.jsonl")
        return min(scored)[1]
    try:
        n = int(step)
    except (TypeError, ValueError):
        raise ValueError(f"--step: expected a step number, 'latest' or 'best', got {step!r}") \
            from None
    if n not in available:
        raise ValueError(f"--step: no checkpoint at step {n}; available: {available}")
    return n


def _pick_data(data: str, data_cfg):
    """(source, its name, data info) for --data: the run's eval or train split (built-in
    or data.source), or a .npz file with `inputs` and `targets`."""
    if data in ("", "eval", "train"):
        train_src, eval_src, info = data_lib.make_sources(data_cfg)
        if data == "train":
            return train_src, "train", info
        if eval_src is None:
            raise ValueError("--data=eval: this run has no eval split")
        return eval_src, "eval", info
    if data.endswith(".npz"):
        if not os.path.exists(data):
            raise FileNotFoundError(f"--data: {data}: no such file")
        with np.load(data) as z:
            arrays = {k: z[k] for k in z.files}
        if "inputs" not in arrays or "targets" not in arrays:
            raise ValueError(f"--data: {data} needs arrays 'inputs' and 'targets', "
                             f"has {sorted(arrays)}")
        return data_lib.as_data(arrays, "--data"), os.path.basename(data), {}
    raise ValueError(f"--data: expected eval, train or a .npz file, got {data!r}")


def read_jsonl(path: str) -> list[dict]:
    """Records of a metrics.jsonl; a torn line (a kill mid-write) is skipped."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def _json_number(v: float):
    return v if math.isfinite(v) else str(v)


def write_report(workdir: str, report: dict, result: Evaluation, *, plots: bool = True
                 ) -> list[str]:
    """eval_<step>.json and the PNGs; returns the file names written."""
    step = report["step"]
    files = [f"eval_{step}.json"]
    if plots:
        from jtrain.observe import plots as plots_lib

        curves = f"eval_{step}_curves.png"
        if plots_lib.training_curves(read_jsonl(os.path.join(workdir, "metrics.jsonl")),
                                     os.path.join(workdir, curves)):
            files.append(curves)
        if "confusion_matrix" in result.arrays:
            name = f"eval_{step}_confusion.png"
            plots_lib.confusion_matrix(result.arrays["confusion_matrix"],
                                       os.path.join(workdir, name),
                                       title=f"confusion matrix, step {step} ({report['data']})")
            files.append(name)
    report = dict(report, files=files)
    with open(os.path.join(workdir, files[0]), "w") as f:
        json.dump(report, f, indent=2)
    return files


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jtrain.evaluate",
                                     description="Evaluate a checkpoint of a jtrain run.")
    parser.add_argument("--workdir", required=True, help="the run's directory")
    parser.add_argument("--step", default="latest", help="N, latest (default) or best")
    parser.add_argument("--data", default="eval", help="eval (default), train or FILE.npz")
    parser.add_argument("--num_batches", type=int, default=0, help="0 = every example")
    parser.add_argument("--no_plots", action="store_true", help="write the JSON only")
    args = parser.parse_args(argv)
    from absl import flags, logging as absl_logging

    if not flags.FLAGS.is_parsed():  # grain and orbax read absl flags
        flags.FLAGS.mark_as_parsed()
    absl_logging.set_verbosity(absl_logging.WARNING)
    from jtrain import checkpoint
    from jtrain import config as config_lib

    try:
        report = evaluate_checkpoint(args.workdir, step=args.step, data=args.data,
                                     num_batches=args.num_batches, plots=not args.no_plots)
    except (FileNotFoundError, ValueError, checkpoint.RestoreError) as e:
        kind = ("config" if isinstance(e, config_lib.ConfigError) else
                "checkpoint" if isinstance(e, checkpoint.RestoreError) else "evaluate")
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        sys.stderr.write(f"jtrain: {kind} error: {first}\n")
        return 2
    print(f"jtrain: eval of step {report['step']} on {report['data']} "
          f"({report['num_examples']:,} examples): {headline(report['metrics'])}")
    print(f"jtrain: wrote {', '.join(report.get('files', []))} in {os.path.abspath(args.workdir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
