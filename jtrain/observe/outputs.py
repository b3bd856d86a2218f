"""What a run shows and records, opened once before the first step: config.json (exactly
the resolved config), run.json (the run's records: where its model and loss came from,
and what the set-up decided beyond the config), the metric writers, the progress display
with the header, the perf meter and the profiler. Process 0 writes; the others mostly
stay quiet.

run.json:

    {"model_source": "python: user Net",    # a model passed from Python (not rebuildable
     "loss_source": "python: my_loss",      #   from the config; jtrain.evaluate says so)
     "decided": {"optim.grad_accum_steps": {"value": 2, "from": "memory plan", ...},
                 "data.batch_size": {"value": 32, "from": "DataLoader"}, ...}}

summary.json repeats "decided".
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

import jax

from jtrain.optim import schedules
from jtrain.config import changes as changes_lib
from jtrain.observe import console, header as header_lib, perf as perf_lib
from jtrain.observe import writers as writers_lib
from jtrain.errors import WorkdirError
from jtrain.observe import layout, runfiles, trust
from jtrain.redact import redact

CONFIG_FILE = "config.json"
RUN_FILE = "run.json"
MODEL_SOURCE_KEY = "model_source"  # run.json: how the run got its model
LOSS_SOURCE_KEY = "loss_source"  # ... and its loss_fn, when one was passed from Python
TX_SOURCE_KEY = "tx_source"  # ... and its optimizer, when train(tx=...) gave one


@dataclasses.dataclass
class Outputs:
    """The run's writers and displays (the loop writes through them)."""
    writer: writers_lib.MetricWriter
    progress: console.Progress
    perf: perf_lib.Meter
    profiler: perf_lib.Profiler
    record: dict  # run.json's content

    def close(self):
        self.profiler.close()
        self.progress.close()
        self.writer.close()


def run_record(*, model_name: str | None, loss_fn: Callable | None, decided: dict,
               tx=None) -> dict:
    """run.json's content: `model_name` of a model passed from Python (None: built from
    the config), `loss_fn` and `tx` passed from Python, the set-up's decisions."""
    record: dict[str, Any] = {}
    if model_name is not None:
        record[MODEL_SOURCE_KEY] = f"python: {model_name}"
    if loss_fn is not None:
        record[LOSS_SOURCE_KEY] = f"python: {getattr(loss_fn, '__name__', 'loss_fn')}"
    if tx is not None:  # config.json's optim.name does not describe the optimizer state
        record[TX_SOURCE_KEY] = f"python: {type(tx).__name__}"
    record["decided"] = decided
    return record


def read_run_record(workdir: str) -> dict:
    """A workdir's run.json; older runs kept model_source / loss_source in config.json.
    {} when neither says anything; a malformed one is one WorkdirError naming it."""
    for name in (RUN_FILE, CONFIG_FILE):
        path = os.path.join(workdir, name)
        try:
            data = runfiles.read_object(path)
        except FileNotFoundError:
            continue
        sources = {k: data[k] for k in (MODEL_SOURCE_KEY, LOSS_SOURCE_KEY, TX_SOURCE_KEY)
                   if k in data}
        problem = runfiles.check_fields(sources, dict.fromkeys(sources, str))
        if problem is not None:
            raise WorkdirError(path, problem)
        return data if name == RUN_FILE else sources
    return {}


def replan_line(start, resolved: dict) -> str | None:
    """What this resume's config changes do to the learning-rate schedule (None: nothing,
    or not a resume). The record's last accepted change at the resumed step is this
    resume's: a checkpoint is never re-saved at the step it was restored from."""
    history = getattr(start.control, "config_changes", None) or []
    if start.step is None or not history or history[-1].get("step") != start.step:
        return None
    changes = {k: tuple(v) for k, v in history[-1]["changes"].items()}
    saved = changes_lib.saved_config(changes, resolved)
    return schedules.replan_line(saved, json.loads(json.dumps(resolved, default=str)),
                                 start.step)


def open_outputs(cfg, workdir: str, *, build, data, start, record: dict,
                 run_ids: dict | None, determinism: str | None,
                 t_start: float, shown: str | None = None) -> Outputs:
    """Writes config.json and run.json, opens the writers, prints the header. `build`: a
    jtrain.engine.assemble.Build, `data`: a jtrain.data.RunData, `start`: the restore-or-init
    result (its step, origin). `shown`: the workdir as the header names it (an
    object-store URI whose staging copy is `workdir`)."""
    primary = jax.process_index() == 0
    resolved = cfg.to_dict()
    if primary:
        for name, content in ((CONFIG_FILE, resolved), (RUN_FILE, record)):
            layout.write_file(os.path.join(workdir, name), json.dumps(
                redact(content), indent=2, sort_keys=True, default=str))
        trust.sign(workdir, required=False)  # the user's own run (observe/trust.py)
        tokenizer = data.info.get("tokenizer_path")  # data.name=tokens: the run keeps it
        if tokenizer:
            with open(tokenizer, "rb") as f:
                layout.write_file(os.path.join(workdir, os.path.basename(tokenizer)), f.read())
    writer = writers_lib.MetricWriter(workdir, cfg.log, is_primary=primary, run_ids=run_ids,
                                      resumed_step=start.step)
    if start.step is None:
        writer.write_hparams(resolved)
    progress = console.Progress(
        cfg.total_steps, start_step=start.step or 0, is_primary=primary,
        every_steps=cfg.log.every_steps, batches_per_epoch=data.info["batches_per_epoch"],
        verbosity=cfg.log.verbosity, log_path=os.path.join(workdir, console.LOG_FILE),
        all_hosts=cfg.log.all_hosts, process_index=jax.process_index())
    peak = perf_lib.peak_flops_per_device(cfg.perf.peak_flops)
    header = header_lib.describe_run(cfg, build, data, workdir=shown or workdir,
                                     origin=start.origin, peak=peak, determinism=determinism)
    replan = replan_line(start, resolved)
    if replan:  # right under "resumed from step N"
        header += "\n" + replan
    progress.message(header)
    writer.write_text(start.step or 0, "run/header", header)  # TensorBoard's text tab
    progress.message(header_lib.parameter_table(build.abstract.params), level=2)
    meter = perf_lib.Meter(start_step=start.step or 0, global_batch=cfg.data.batch_size,
                           flops_per_example=build.flops_per_example, peak_flops=peak,
                           num_devices=jax.device_count(), t_start=t_start)
    profiler = perf_lib.Profiler(cfg.profile, workdir, is_primary=primary)
    return Outputs(writer, progress, meter, profiler, record)
