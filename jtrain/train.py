"""`train()`: the one engine behind the CLI and the library.

Wiring in data-flow order: config -> mesh -> data -> model, optimizer -> abstract state
-> shardings -> restore-or-init -> jitted steps; then the loop. Each piece lives in the
module that owns it; this file only connects them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from collections import deque
from typing import Any, Callable

import jax
import numpy as np
from flax import linen as nn

from jtrain import checkpoint, eval_loop, losses
from jtrain import config as config_lib
from jtrain import control as control_lib
from jtrain import data as data_lib
from jtrain import mesh as mesh_lib
from jtrain import models as models_lib
from jtrain import optim as optim_lib
from jtrain.observe import perf as perf_lib
from jtrain import precision as precision_lib
from jtrain import state as state_lib
from jtrain import step as step_lib
from jtrain.models import adapters
from jtrain.observe import console, header as header_lib
from jtrain.observe import writers as writers_lib
from jtrain.observe.redact import redact


@dataclasses.dataclass
class TrainResult:
    state: state_lib.TrainState
    history: list[dict[str, float]]  # one entry per evaluation: {"step": s, "eval/...": v}
    summary: dict[str, Any]


def train(config=None, workdir: str | None = None, *, model=None, train_data=None,
          eval_data=None, loss_fn: Callable | None = None) -> TrainResult:
    """Train `model` (built-in from config.model if None) on `train_data` (built-in from
    config.data if None). Resumes from the newest checkpoint in `workdir`.

    `loss_fn(outputs, batch)` returns `(loss_sum, weight_sum)` (exact token weighting)
    or a scalar mean; default: cross-entropy for int targets, MSE for float targets.
    """
    if workdir is None:
        raise ValueError("workdir: required (the run's identity: checkpoints, logs, summary)")
    cfg = config_lib.resolve(config)
    # data.source factories run, and a torch DataLoader's settings become data.*, before
    # the batch is checked against the devices.
    train_data, eval_data, overrides = data_lib.load_user_data(
        cfg.data, train_data, eval_data, process_index=jax.process_index(),
        process_count=jax.process_count())
    if overrides:  # a new config: a validated one is never changed in place
        cfg = config_lib.resolve({**cfg.to_dict(), "data": {**cfg.data.to_dict(), **overrides}})
    config_lib.validate(cfg, num_devices=jax.device_count())
    # From here on SIGTERM / SIGINT mean: save the current step, stop, return (jtrain.control.signals).
    with control_lib.Stopper(cfg.checkpoint.grace_seconds) as stopper:
        run = _setup(cfg, os.path.abspath(workdir), model, train_data, eval_data, loss_fn)
        run.stopper = stopper
        try:
            # Steps trace under the mesh and the logical-axis rules, so models' activation
            # constraints (nn.with_logical_constraint) resolve to this mesh.
            with jax.set_mesh(run.build.mesh), nn.logical_axis_rules(mesh_lib.LOGICAL_RULES):
                return _loop(cfg, run)
        finally:
            run.close()


@dataclasses.dataclass(frozen=True)
class Build:
    """What `build` sets up: everything a run, an evaluation or a benchmark needs before
    the first array exists. `init()` builds the fresh state directly in its shardings."""
    mesh: Any
    policy: precision_lib.Policy
    model_fns: adapters.ModelFns
    model_name: str  # the built-in family, or "user <Class>"
    user_model: Any  # the model object given to train(), None for a built-in
    tx: Any
    schedule: Callable
    sample_inputs: Any  # ShapeDtypeStructs of one global batch of inputs
    abstract: state_lib.TrainState  # ShapeDtypeStructs
    shardings: Any  # NamedShardings, same tree
    eval_spec: Any  # jtrain.metrics.EvalSpec
    train_step: Callable  # jit(state, batch) -> (state, metrics), state donated
    eval_step: Callable  # jit(params, batch) -> (metric states, batch rows)
    seed: int

    def init(self) -> state_lib.TrainState:
        return state_lib.init_state(self.model_fns, self.tx, self.policy, self.sample_inputs,
                                    self.mesh, self.seed, self.shardings)

    def abstract_with_shardings(self):
        """What orbax restores into."""
        return checkpoint.abstract_with_shardings(self.abstract, self.shardings)


def build(cfg, *, sample, eval_example: dict, model=None, loss_fn: Callable | None = None,
          byte_level: bool = False, eval_defaults: bool = False) -> Build:
    """Model, mesh, optimizer, abstract state and shardings, jitted steps: the set-up that
    training, `python -m jtrain.evaluate` and the benchmarks share. `sample`: one example's
    inputs (any pytree of arrays), `eval_example`: one eval example (for its targets).
    `eval_defaults`: the task's default metrics on top of `eval.metrics` (the report)."""
    mesh = mesh_lib.make_mesh(cfg.mesh)
    policy = precision_lib.make_policy(cfg.model)
    name = cfg.model.name if model is None else f"user {type(model).__name__}"
    module = model if model is not None else models_lib.make_model(
        cfg.model, dtype=policy.compute_dtype, param_dtype=policy.param_dtype)
    model_fns = adapters.to_model_fns(module, mesh)
    tx, schedule = optim_lib.make_optimizer(cfg.optim, cfg.total_steps)
    sample_inputs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        (cfg.data.batch_size,) + np.shape(x), np.asarray(x).dtype), sample)
    abstract, shardings = state_lib.make_abstract_state(
        model_fns, tx, policy, sample_inputs, mesh, cfg.seed)

    batch_sharding, repl = mesh_lib.batch_sharding(mesh), mesh_lib.replicated(mesh)
    train_step = jax.jit(
        step_lib.make_train_step(model_fns.apply, loss_fn or losses.default_loss, tx, schedule,
                                 grad_accum_steps=cfg.optim.grad_accum_steps,
                                 dynamic_loss_scale=policy.dynamic_loss_scale),
        in_shardings=(shardings, batch_sharding), out_shardings=(shardings, repl),
        donate_argnums=0)
    eval_spec = eval_loop.make_spec(cfg.eval, model_fns.apply, abstract.params, sample_inputs,
                                    eval_example, byte_level=byte_level,
                                    with_defaults=eval_defaults)
    eval_step = jax.jit(step_lib.make_eval_step(model_fns.apply, loss_fn or losses.default_loss,
                                                user_loss=loss_fn is not None,
                                                metrics=eval_spec),
                        in_shardings=(shardings.params, batch_sharding),
                        out_shardings=(repl, batch_sharding))
    return Build(mesh, policy, model_fns, name, model, tx, schedule, sample_inputs, abstract,
                 shardings, eval_spec, train_step, eval_step, cfg.seed)


@dataclasses.dataclass
class _Outputs:
    """What the run shows and records (process 0 writes; the others mostly stay quiet)."""
    writer: Any  # observe.writers.MetricWriter
    progress: Any  # observe.console.Progress
    perf: Any  # observe.perf.Meter
    profiler: Any  # observe.perf.Profiler

    def close(self):
        self.profiler.close()
        self.progress.close()
        self.writer.close()


@dataclasses.dataclass
class _Run:
    workdir: str
    build: Build
    state: Any
    train_iter: Any
    eval_source: Any
    data_info: dict
    ckpt: checkpoint.Checkpointer
    out: _Outputs
    resumed_from: int | None
    stopper: Any = None  # control.Stopper: signals -> stop after a step

    def close(self):
        self.out.close()
        self.ckpt.close()
        if hasattr(self.train_iter, "close"):
            self.train_iter.close()


def _setup(cfg, workdir, model, train_data, eval_data, loss_fn) -> _Run:
    t_start = time.perf_counter()
    primary = jax.process_index() == 0
    os.makedirs(workdir, exist_ok=True)

    # Checked here (DataError before any step); the data's shapes come from a sample batch.
    train_src, eval_src, data_info = data_lib.make_sources(
        cfg.data, train_data, eval_data, process_index=jax.process_index(),
        process_count=jax.process_count(), gather=mesh_lib.process_values)
    sample = train_src[0]["inputs"]  # example 0 as the model sees it (after collate_fn)
    b = build(cfg, sample=sample, eval_example=(eval_src if eval_src is not None
                                                else train_src)[0],
              model=model, loss_fn=loss_fn, byte_level=data_info.get("name") == "pystdlib")

    # Start-up precedence (jtrain.checkpoint.manager, WORKSPACE.md): (1) the newest intact
    # checkpoint in workdir/checkpoints; (2) else checkpoint.init_from; (3) else fresh.
    ckpt = checkpoint.Checkpointer(workdir, cfg, data_info)
    start = ckpt.restore_or_init(b.abstract_with_shardings(), b.init)
    train_iter = data_lib.make_train_iterator(
        train_src, local_batch=cfg.data.batch_size // jax.process_count(), seed=cfg.seed,
        shuffle=cfg.data.shuffle, process_index=jax.process_index(),
        process_count=jax.process_count(), num_workers=cfg.data.num_workers,
        drop_last=cfg.data.drop_last, prefetch=cfg.data.prefetch,
        num_threads=cfg.data.num_threads)
    if start.data_state is not None:
        train_iter.set_state(start.data_state)
    # The next batches go onto the devices in a background thread (the one transfer,
    # mesh.host_to_device); get_state() stays the position of the step's next batch.
    train_iter = data_lib.device_prefetch(
        train_iter, functools.partial(mesh_lib.host_to_device, mesh=b.mesh),
        cfg.data.device_prefetch)

    resolved = cfg.to_dict()
    if primary:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(redact(resolved), f, indent=2, sort_keys=True, default=str)
    writer = writers_lib.MetricWriter(workdir, cfg.log, is_primary=primary,
                                      run_ids=control_lib.writer_run_ids(start.control))
    ckpt.control.writer_run_ids = writer.run_ids()  # checkpointed, reused on resume
    if start.step is None:
        writer.write_hparams(resolved)
    progress = console.Progress(
        cfg.total_steps, start_step=start.step or 0, is_primary=primary,
        every_steps=cfg.log.every_steps, batches_per_epoch=data_info["batches_per_epoch"],
        verbosity=cfg.log.verbosity, log_path=os.path.join(workdir, console.LOG_FILE),
        all_hosts=cfg.log.all_hosts, process_index=jax.process_index())
    flops = perf_lib.model_flops_per_example(b.user_model, cfg.model,
                                             jax.tree.map(np.shape, sample))
    peak = perf_lib.peak_flops_per_device(cfg.perf.peak_flops)
    header = _header(cfg, b, data_info, (train_src, eval_src), workdir, start.step, flops, peak)
    progress.message(header)
    writer.write_text(start.step or 0, "run/header", header)  # TensorBoard's text tab
    progress.message(header_lib.parameter_table(b.abstract.params), level=2)
    meter = perf_lib.Meter(start_step=start.step or 0, global_batch=cfg.data.batch_size,
                           flops_per_example=flops, peak_flops=peak,
                           num_devices=jax.device_count(), t_start=t_start)
    profiler = perf_lib.Profiler(cfg.profile, workdir, is_primary=primary)
    return _Run(workdir, b, start.state, train_iter, eval_src, data_info, ckpt,
                _Outputs(writer, progress, meter, profiler), start.step)


def _header(cfg, b: Build, data_info, sources, workdir, resumed_from, flops, peak) -> str:
    train_src, eval_src = sources
    extra = []
    if "fingerprint" in data_info:
        extra.append(f"jtrain: corpus sha256 {data_info['fingerprint'][:16]}..., "
                     f"{data_info['num_bytes']:,} bytes from {data_info['num_files']} files")
    extra += [f"jtrain: data: {note}" for note in data_info.get("notes", ())]
    mfu = f"MFU vs peak {peak:.3g} FLOP/s/device" if peak else "MFU n/a (set perf.peak_flops)"
    extra.append(f"jtrain: eval {b.eval_spec.task}: {', '.join(b.eval_spec.names)}; "
                 + (f"{flops:.3g} train FLOPs/example, {mfu}" if flops else "MFU n/a"))
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(b.abstract.params))
    return header_lib.run_header(
        model=f"{b.model_name} ({b.model_fns.kind})", num_params=n_params,
        precision=b.policy.describe(), mesh_shape=dict(b.mesh.shape),
        data_name=str(data_info.get("name")), train_size=len(train_src),
        eval_size=len(eval_src) if eval_src is not None else 0,
        global_batch=cfg.data.batch_size, workdir=workdir, resumed_from=resumed_from,
        batches_per_epoch=data_info.get("batches_per_epoch"), extra=tuple(extra))


def _loop(cfg, run: _Run) -> TrainResult:
    state, total = run.state, cfg.total_steps
    start = int(jax.device_get(state.step))
    pending: deque = deque()  # (step, metrics on device): bounded steps in flight
    history: list[dict] = []
    evaluate_now = _evaluator(cfg, run)

    for step in range(start + 1, total + 1):
        run.out.profiler.before_step(step)
        t0 = time.perf_counter()
        batch = next(run.train_iter)  # on the devices already (data.device_prefetch)
        t1 = time.perf_counter()
        state, metrics = run.build.train_step(state, batch)
        run.out.perf.step_done(step, t1 - t0, time.perf_counter() - t1,
                           metrics if step == start + 1 else None)  # first: compile time
        if run.out.profiler.after_step(step, metrics):
            run.out.progress.message(f"jtrain: profile trace written to {run.out.profiler.directory}")
        pending.append((step, metrics))
        if len(pending) > cfg.max_steps_in_flight:
            _drain(pending.popleft(), cfg, run)
        if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step != total:
            while pending:  # log lines before the eval line (eval waits for the state anyway)
                _drain(pending.popleft(), cfg, run)
            history += run.stopper.interruptible(evaluate_now, state, step)  # [] if a signal came
        stop = run.stopper.should_stop(step)  # SIGTERM/SIGINT, the same step on all processes
        if stop or run.ckpt.due(step):
            run.ckpt.save(step, state, run.train_iter.get_state(), evals=history,
                          stopped_by=run.stopper.signal_name)
        if stop:
            break
    while pending:
        _drain(pending.popleft(), cfg, run)

    end = step if total > start else start  # the last step run (< total if stopped)
    if end == total and (total > start or not history):
        history += run.stopper.interruptible(evaluate_now, state, total)
    if run.ckpt.latest_step() != end:
        run.ckpt.save(end, state, run.train_iter.get_state(), evals=history,
                      stopped_by=run.stopper.signal_name)
    run.ckpt.wait()  # a failed write ends the run with an error, before any summary
    summary = _summary(cfg, run, state, history[-1] if history else {})
    return TrainResult(state=state, history=history, summary=summary)


def _drain(item, cfg, run: _Run) -> None:
    """Wait for an old step (bounds dispatch); on log steps, fetch and write metrics."""
    step, metrics = item
    if step % cfg.log.every_steps and step != cfg.total_steps:
        jax.block_until_ready(metrics["train/loss"])
        return
    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if not np.isfinite(values["train/loss"]) and "train/loss_scale" not in values:
        raise FloatingPointError(
            f"training diverged: train/loss is {values['train/loss']} at step {step} "
            "(lower optim.lr, set optim.clip_norm, or use model.dtype=float32)")
    values.update(run.out.perf.log_values(step, values.pop("train/tokens")))
    run.out.writer.write_scalars(step, values)
    run.out.progress.update(step, values)
    if cfg.log.verbosity >= 2:
        run.out.progress.message(run.out.perf.debug_line(), level=2)


def _evaluator(cfg, run: _Run):
    eval_batch = (cfg.eval.batch_size or cfg.data.batch_size) // jax.process_count()

    def evaluate_now(state, step: int) -> dict:
        if run.eval_source is None:
            return {"step": step}
        t0 = time.perf_counter()
        result = eval_loop.run_eval(run.build.eval_step, state.params, run.eval_source,
                                    mesh=run.build.mesh, local_batch=eval_batch,
                                   max_batches=cfg.eval.num_batches, spec=run.build.eval_spec)
        run.out.perf.add("eval", time.perf_counter() - t0)
        run.out.writer.write_scalars(step, result.scalars)
        run.out.progress.message(eval_loop.format_line(step, result))
        return {"step": step, **result.scalars}

    return evaluate_now


def _summary(cfg, run: _Run, state, last_eval: dict) -> dict:
    summary = {
        "step": int(jax.device_get(state.step)),
        "state_sha256": state_lib.state_sha256(state),
        "skipped_steps": int(jax.device_get(state.skipped_steps)),
        "resumed_from": run.resumed_from,
        "stopped_by": run.stopper.signal_name if run.stopper else None,  # SIGTERM / SIGINT
        **{k: v for k, v in last_eval.items() if k != "step"},
        **run.out.perf.summary(),
    }
    baseline = run.data_info.get("unigram_baseline")
    if baseline is not None:
        summary["unigram_baseline"] = baseline
        summary["data_fingerprint"] = run.data_info["fingerprint"]
        if "eval/loss" in summary:
            run.out.progress.message(f"jtrain: final eval loss {summary['eval/loss']:.4f} nats/byte "
                                 f"vs unigram baseline {baseline:.4f}")
    run.out.progress.message(_final_line(summary), level=0)
    if jax.process_index() == 0:
        with open(os.path.join(run.workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2, sort_keys=True)
    return summary


def _final_line(summary: dict) -> str:
    """The one line printed even at verbosity 0."""
    evals = eval_loop.headline(summary)
    rate = summary.get("perf/steps_per_sec")
    return (f"jtrain: done at step {summary['step']}" + (f"; eval {evals}" if evals else "")
            + (f"; {rate:.2f} steps/s" if rate else "")
            + (f"; {summary['skipped_steps']} skipped steps" if summary["skipped_steps"] else ""))
