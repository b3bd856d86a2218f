"""`python -m jtrain.evaluate`: evaluate a checkpoint, write a report. The eval loop
itself is `jtrain.engine.evaluation` (shared with training; its names are re-exported here, e.g.
`jtrain.evaluate.run_eval` for runs of your own model).

    python -m jtrain.evaluate --workdir=runs/base [--step=N|best|latest]
                              [--data=eval|train|FILE.npz] [--num_batches=N] [--no_plots]
                              [--weights=params|ema|both]

writes WORKDIR/eval_<step>.json (every metric, the confusion matrix for classification)
and PNGs beside it: eval_<step>_curves.png (training curves from metrics.jsonl),
eval_<step>_confusion.png and goodput.png (goodput.jsonl: each session's seconds by
category). `best` is the best checkpoint by checkpoint.monitor /
checkpoint.mode as logged in metrics.jsonl, ties going to the newer step (the rule
checkpoint retention uses: jtrain.checkpoint.policy.best_steps). `--weights=ema` scores the
weight EMA (a run with optim.ema.decay > 0), its metrics named eval/ema/<name>; `both` the
params and the EMA; the default is the run's eval.weights.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import jax
import numpy as np

from jtrain import checkpoint
from jtrain import config as config_lib
from jtrain import data as data_lib
from jtrain import mesh as mesh_lib
from jtrain.checkpoint import integrity, policy
from jtrain.engine.assemble import LOSS_SOURCE_KEY, MODEL_SOURCE_KEY, build, model_sample
from jtrain.observe.outputs import TX_SOURCE_KEY
from jtrain.engine.evaluation import (MAX_IN_FLIGHT, Evaluation, evaluate_weights,  # noqa: F401
                                      format_line, headline, local_rows, make_spec, run_eval)
from jtrain.errors import EvaluateError, UsageError
from jtrain.metrics.classification import classification_report
from jtrain.observe import layout
from jtrain.observe import jsonl, runfiles, trust
from jtrain.observe import compiles as compiles_lib
from jtrain.observe.outputs import read_run_record


def evaluate_checkpoint(workdir: str, *, step: str | int = "latest", data="eval",
                        num_batches: int = 0, plots: bool = True, model=None,
                        loss_fn=None, weights: str | None = None, tx=None) -> dict:
    """Evaluates a checkpoint of a run and writes the report files. The model is rebuilt
    from config.json (a built-in family or model.factory), the loss from loss.fn /
    loss.terms; `model` / `loss_fn` / `tx`: the objects a run was given from Python (the same
    ones, or ones built the same way). `weights`: "params", "ema" (the weight EMA) or
    "both"; None = the run's eval.weights.

    The model, mesh, state and eval step come from `jtrain.engine.run.build`, as in training.
    Returns the report (what eval_<step>.json holds).

    Examples:
        ```python
        from jtrain.evaluate import evaluate_checkpoint

        report = evaluate_checkpoint("runs/a", step="best", data=(x_eval, y_eval),
                                     model=Net, plots=False)   # Net: the model trained
        print(report["step"], report["metrics"]["eval/accuracy"])
        ```
    """
    from flax import linen as nn

    opened = open_run(workdir, model=model, loss_fn=loss_fn, weights=weights, data=data, tx=tx,
                      eval_defaults=True)
    cfg, b, weights, workdir = opened.cfg, opened.build, opened.weights, opened.workdir
    if plots:  # goodput.png's ledger read first: a hostile one is one line before the eval
        goodput_sessions(workdir)
    chosen = resolve_step(step, opened.reader.all_steps(), workdir,
                          monitor=cfg.checkpoint.monitor, mode=cfg.checkpoint.mode)
    state = opened.reader.restore(chosen, b.abstract_with_shardings())[0]
    eval_batch = (cfg.eval.batch_size or cfg.data.batch_size) // jax.process_count()
    with jax.set_mesh(b.mesh), nn.logical_axis_rules(mesh_lib.LOGICAL_RULES):
        result = evaluate_weights(b.eval_step, state, opened.source, weights=weights,
                                  mesh=b.mesh, local_batch=eval_batch, spec=b.eval_spec,
                                  max_batches=num_batches, tail_step=b.eval_tail)
    report = {
        "step": chosen, "data": opened.data_name, "task": b.eval_spec.task, "weights": weights,
        "num_examples": result.num_examples,
        "metrics": {k: _json_number(v) for k, v in result.scalars.items()},
        **{k: v.tolist() for k, v in result.arrays.items()},
    }
    for prefix in ("", "ema_"):  # per class and averaged, as sklearn's
        if f"{prefix}confusion_matrix" in result.arrays:
            report[f"{prefix}classification_report"] = classification_report(
                result.arrays[f"{prefix}confusion_matrix"])
    if jax.process_index() == 0:
        files = write_report(workdir, report, result, plots=plots)
        report["files"] = files
    return report


@dataclasses.dataclass
class Opened:
    """A run opened for evaluation: its config, the build of its model, a read-only
    reader of its checkpoints and the data scored."""
    workdir: str
    cfg: Any
    build: Any
    reader: checkpoint.CheckpointReader
    source: Any
    data_name: str
    weights: str


def open_run(workdir: str, *, model=None, loss_fn=None, weights: str | None = None,
             data="eval", eval_defaults: bool = True, tx=None) -> Opened:
    """The run at `workdir` read back (config.json checked as trusted, the model and
    loss rebuilt, the data picked) for `evaluate_checkpoint` and `jtrain evaluate
    --follow`; `eval_defaults`: the task's default metrics besides eval.metrics (False:
    exactly the metrics the run's own evaluations compute)."""
    shown, workdir = workdir, os.path.abspath(workdir)
    cfg_path = os.path.join(workdir, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"--workdir: {workdir} has no config.json (not a jtrain run)")
    recorded = runfiles.read_object(cfg_path)
    layout.check_folders(workdir)  # evals/ (--follow) written into, never through a link
    trust.check(workdir, recorded, shown=shown,  # before anything it names is imported
                skip=("model.",) * (model is not None) + ("loss.",) * (loss_fn is not None))
    sources = read_run_record(workdir)  # run.json (older runs: config.json)
    source = sources.get(MODEL_SOURCE_KEY)
    if source is not None and model is None:
        raise EvaluateError(
            f"--workdir: {workdir} was trained with a model passed from Python "
            f"({source.split(': ', 1)[-1]}); the CLI cannot rebuild it: call "
            "jtrain.evaluate.evaluate_checkpoint(workdir, model=...) from Python, or train "
            "with model.name='user' and model.factory='package.module:function'")
    loss_source = sources.get(LOSS_SOURCE_KEY)
    if loss_source is not None and loss_fn is None:
        raise EvaluateError(
            f"--workdir: {workdir} was trained with a loss_fn passed from Python "
            f"({loss_source}); the CLI cannot rebuild it: call "
            "jtrain.evaluate.evaluate_checkpoint(workdir, loss_fn=...) from Python, or train "
            "with loss.fn='package.module:function' (or loss.terms)")
    tx_source = sources.get(TX_SOURCE_KEY)
    if tx_source is not None and tx is None:  # its state is not optim.name's
        raise EvaluateError(
            f"--workdir: {workdir} was trained with an optimizer passed from Python "
            f"(train(tx=...): {tx_source.split(': ', 1)[-1]}); its state is not what "
            "config.json's optim.name builds: call jtrain.evaluate.evaluate_checkpoint("
            "workdir, tx=...) with the same optax transformation")
    cfg = config_lib.resolve(recorded)
    if cfg.population.size > 1:  # the state holds every member: evaluate one's export
        raise UsageError(f"{workdir} trained a population of {cfg.population.size} members: "
                         "export one (python -m jtrain.export RUN --out=DIR --member=i) and "
                         "evaluate that export")
    weights = weights or cfg.eval.weights
    if weights not in ("params", "ema", "both"):
        raise UsageError(f"--weights: expected params, ema or both, got {weights!r}")
    if weights != "params" and not cfg.optim.ema.get("decay", 0.0):
        raise EvaluateError(f"--weights={weights}: {workdir} keeps no weight EMA "
                            "(optim.ema.decay = 0)")
    config_lib.validate(cfg, num_devices=jax.device_count())
    compiles_lib.configure_cache_for_reader(cfg.compile.cache_dir)
    reader = checkpoint.CheckpointReader(workdir)  # read-only: safe beside a running job
    source, data_name, data_info = _pick_data(data, cfg.data, workdir)
    b = build(cfg, sample=model_sample(cfg, source[0]), eval_example=source[0], model=model,
              loss_fn=loss_fn,
              byte_level=data_info.get("name") == "pystdlib"
              or bool(data_info.get("byte_level")), eval_defaults=eval_defaults,
              tx=tx)
    return Opened(workdir=workdir, cfg=cfg, build=b, reader=reader, source=source,
                  data_name=data_name, weights=weights)


def resolve_step(step, available: list[int], workdir: str, *, monitor: str | None = None,
                 mode: str | None = None) -> int:
    """`latest`, N, or `best`: the checkpoint whose `monitor` value logged in metrics.jsonl
    is lowest (mode min) or highest (max), ties to the newer step, exactly as checkpoint
    retention ranks them (`policy.best_steps`): checkpoint.monitor / checkpoint.mode."""
    ckpt_schema = config_lib.SCHEMA["checkpoint"]
    monitor = monitor or ckpt_schema["monitor"].default
    mode = mode or ckpt_schema["mode"].default
    if not available:
        raise FileNotFoundError(f"--workdir: {workdir} has no finished checkpoints")
    if step in (None, "", "latest"):
        return max(available)
    if step == "best":
        best = policy.best_logged_step(workdir, available, monitor, mode)
        if best is None:
            raise ValueError(f"--step=best: no checkpoint step of {available} has a logged "
                             f"{monitor} in metrics.jsonl")
        return best
    n = step if type(step) is int else integrity.parse_step(step)
    if n is None:
        raise ValueError(f"--step: expected a step number, 'latest' or 'best', got {step!r}")
    if n not in available:
        raise ValueError(f"--step: no checkpoint at step {n}; available: {available}")
    return n


def _pick_data(data: str, data_cfg, workdir: str):
    """(source, its name, data info) for --data: the run's eval or train split (built-in
    or data.source), or a .npz file with `inputs` and `targets`; from Python also any
    input `jtrain.train` accepts (arrays, a torch Dataset, ...). Token shards in a
    bucket are read through the run's copies (WORKDIR/token_shards/)."""
    if not isinstance(data, str):
        return data_lib.as_data(data, "data"), "data", {}
    if data in ("", "eval", "train"):
        train_src, eval_src, info = data_lib.make_sources(data_cfg, cache=workdir)
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
    return jsonl.read_records(path)


def _json_number(v: float):
    return v if math.isfinite(v) else str(v)


def goodput_sessions(workdir: str) -> list[dict]:
    """The run's sessions from goodput.jsonl (observe.goodput.sessions); [] without it."""
    from jtrain.observe import goodput

    try:
        records = goodput.read(workdir)
    except FileNotFoundError:
        return []
    return goodput.sessions(records) if records else []


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
        matrix = result.arrays.get("confusion_matrix",
                                   result.arrays.get("ema_confusion_matrix"))
        if matrix is not None:
            name = f"eval_{step}_confusion.png"
            plots_lib.confusion_matrix(matrix,
                                       os.path.join(workdir, name),
                                       title=f"confusion matrix, step {step} ({report['data']})")
            files.append(name)
        sessions = goodput_sessions(workdir)
        if sessions:
            plots_lib.goodput_bars(sessions, os.path.join(workdir, "goodput.png"))
            files.append("goodput.png")
    report = dict(report, files=files)
    layout.write_file(os.path.join(workdir, files[0]), json.dumps(report, indent=2))
    return files
