"""`train()`: the one engine behind the CLI and the library.

Wiring in data-flow order: config -> mesh -> data -> model, optimizer -> abstract state
-> shardings -> restore-or-init -> jitted steps; then the loop. Each piece lives in the
module that owns it; this file only connects them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections import deque
from typing import Any, Callable

import jax
import numpy as np

from jtrain import adapters, checkpoint, evaluate, losses
from jtrain import config as config_lib
from jtrain import data as data_lib
from jtrain import mesh as mesh_lib
from jtrain import models as models_lib
from jtrain import optim as optim_lib
from jtrain import precision as precision_lib
from jtrain import state as state_lib
from jtrain import step as step_lib
from jtrain import progress as progress_lib
from jtrain import writers as writers_lib


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
    config_lib.validate(cfg, num_devices=jax.device_count())
    run = _setup(cfg, os.path.abspath(workdir), model, train_data, eval_data, loss_fn)
    try:
        return _loop(cfg, run)
    finally:
        run.close()


@dataclasses.dataclass
class _Run:
    workdir: str
    mesh: Any
    state: Any
    shardings: Any
    train_iter: Any
    eval_source: Any
    train_step: Callable
    eval_step: Callable
    ckpt: checkpoint.Checkpointer
    writer: Any
    progress: Any
    meta: dict
    data_info: dict
    resumed_from: int | None

    def close(self):
        self.progress.close()
        self.ckpt.close()
        self.writer.close()
        if hasattr(self.train_iter, "close"):
            self.train_iter.close()


def _setup(cfg, workdir, model, train_data, eval_data, loss_fn) -> _Run:
    primary = jax.process_index() == 0
    os.makedirs(workdir, exist_ok=True)
    mesh = mesh_lib.make_mesh(cfg.mesh)
    policy = precision_lib.make_policy(cfg.model)

    train_src, eval_src, data_info = data_lib.make_sources(cfg.data, train_data, eval_data)
    data_lib.check_source(train_src, global_batch=cfg.data.batch_size, name="train_data")
    local_batch = cfg.data.batch_size // jax.process_count()

    model_name = cfg.model.name if model is None else f"user {type(model).__name__}"
    if model is None:
        model = models_lib.make_model(cfg.model, dtype=policy.compute_dtype,
                                      param_dtype=policy.param_dtype)
    model_fns = adapters.to_model_fns(model)
    tx, schedule = optim_lib.make_optimizer(cfg.optim, cfg.total_steps)
    sample = train_src[0]["inputs"]
    sample_inputs = jax.ShapeDtypeStruct((cfg.data.batch_size,) + np.shape(sample),
                                         np.asarray(sample).dtype)

    abstract, shardings = state_lib.make_abstract_state(
        model_fns, tx, policy, sample_inputs, mesh, cfg.seed)
    ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), cfg.checkpoint)
    restored = ckpt.restore_latest(checkpoint.abstract_with_shardings(abstract, shardings))
    train_iter = data_lib.make_train_iterator(
        train_src, local_batch=local_batch, seed=cfg.seed, shuffle=cfg.data.shuffle,
        process_index=jax.process_index(), process_count=jax.process_count(),
        num_workers=cfg.data.num_workers)
    if restored is None:
        state = state_lib.init_state(model_fns, tx, policy, sample_inputs, mesh, cfg.seed,
                                     shardings)
        resumed_from = None
    else:
        resumed_from, state, data_state, _ = restored
        train_iter.set_state(data_state)

    user_loss = loss_fn is not None
    loss_fn = loss_fn or losses.default_loss
    batch_sharding = mesh_lib.batch_sharding(mesh)
    repl = mesh_lib.replicated(mesh)
    train_step = jax.jit(
        step_lib.make_train_step(model_fns.apply, loss_fn, tx, schedule,
                                 grad_accum_steps=cfg.optim.grad_accum_steps,
                                 dynamic_loss_scale=policy.dynamic_loss_scale),
        in_shardings=(shardings, batch_sharding), out_shardings=(shardings, repl),
        donate_argnums=0)
    eval_step = jax.jit(step_lib.make_eval_step(model_fns.apply, loss_fn, user_loss=user_loss),
                        in_shardings=(shardings.params, batch_sharding), out_shardings=repl)

    resolved = cfg.to_dict()
    meta = {"config_sha256": config_lib.config_hash(cfg), "data": data_info,
            "jax": jax.__version__}
    if primary:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(writers_lib.redact(resolved), f, indent=2, sort_keys=True, default=str)
    writer = writers_lib.MetricWriter(workdir, cfg.log, is_primary=primary)
    if resumed_from is None:
        writer.write_hparams(resolved)
    progress = progress_lib.Progress(cfg.total_steps, start_step=resumed_from or 0,
                                    is_primary=primary, every_steps=cfg.log.every_steps)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract.params))
    progress.message(_header(cfg, mesh, policy, model_name, model_fns, n_params, data_info, train_src,
                             eval_src, workdir, resumed_from))
    return _Run(workdir, mesh, state, shardings, train_iter, eval_src, train_step, eval_step,
                ckpt, writer, progress, meta, data_info, resumed_from)


def _header(cfg, mesh, policy, name, model_fns, n_params, data_info, train_src, eval_src, workdir,
            resumed_from) -> str:
    shape = " x ".join(f"{k}={v}" for k, v in mesh.shape.items())
    lines = [
        f"jtrain: model {name} ({model_fns.kind}), {n_params:,} params, {policy.describe()}",
        f"jtrain: {jax.device_count()} {jax.default_backend()} devices, "
        f"{jax.process_count()} process(es), mesh {shape}",
        f"jtrain: data {data_info.get('name')}: {len(train_src):,} train / "
        f"{len(eval_src) if eval_src is not None else 0:,} eval examples, "
        f"global batch {cfg.data.batch_size}",
        f"jtrain: workdir {workdir}; " + (f"resumed from step {resumed_from}"
                                         if resumed_from is not None else "fresh start"),
    ]
    if "fingerprint" in data_info:
        lines.insert(3, f"jtrain: corpus sha256 {data_info['fingerprint'][:16]}..., "
                        f"{data_info['num_bytes']:,} bytes from {data_info['num_files']} files")
    return "\n".join(lines)


def _loop(cfg, run: _Run) -> TrainResult:
    state, total = run.state, cfg.total_steps
    start = int(jax.device_get(state.step))
    pending: deque = deque()  # (step, metrics on device): bounded steps in flight
    history: list[dict] = []
    clock = {"t": time.perf_counter(), "step": start}
    evaluate_now = _evaluator(cfg, run)

    for step in range(start + 1, total + 1):
        batch = mesh_lib.host_to_device(next(run.train_iter), run.mesh)
        state, metrics = run.train_step(state, batch)
        pending.append((step, metrics))
        if len(pending) > cfg.max_steps_in_flight:
            _drain(pending.popleft(), cfg, run, clock)
        if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step != total:
            history.append(evaluate_now(state, step))
        if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0:
            run.ckpt.save(step, state, run.train_iter.get_state(), run.meta)
    while pending:
        _drain(pending.popleft(), cfg, run, clock)

    if total > start or not history:
        history.append(evaluate_now(state, total))
    if run.ckpt.latest_step() != total:
        run.ckpt.save(total, state, run.train_iter.get_state(), run.meta, force=True)
    summary = _summary(cfg, run, state, history[-1] if history else {})
    return TrainResult(state=state, history=history, summary=summary)


def _drain(item, cfg, run: _Run, clock: dict) -> None:
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
    now = time.perf_counter()
    rate = (step - clock["step"]) / max(now - clock["t"], 1e-9)
    clock.update(t=now, step=step)
    values["perf/steps_per_sec"] = rate
    values["perf/examples_per_sec"] = rate * cfg.data.batch_size
    values["perf/tokens_per_sec"] = rate * values.pop("train/tokens")
    run.writer.write_scalars(step, values)
    run.progress.update(step, values)


def _evaluator(cfg, run: _Run):
    eval_batch = (cfg.eval.batch_size or cfg.data.batch_size) // jax.process_count()
    is_bytes = run.data_info.get("name") == "pystdlib"

    def evaluate_now(state, step: int) -> dict:
        if run.eval_source is None:
            return {"step": step}
        metrics = evaluate.run_eval(run.eval_step, state.params, run.eval_source,
                                    mesh=run.mesh, local_batch=eval_batch,
                                    max_batches=cfg.eval.num_batches,
                                    bytes_per_token=is_bytes)
        run.writer.write_scalars(step, metrics)
        run.progress.message(f"jtrain: eval at step {step}: " + ", ".join(
            f"{k.split('/', 1)[1]} {v:.4f}" for k, v in metrics.items()
            if k != "eval/examples_weight"))
        return {"step": step, **metrics}

    return evaluate_now


def _summary(cfg, run: _Run, state, last_eval: dict) -> dict:
    summary = {
        "step": int(jax.device_get(state.step)),
        "state_sha256": state_lib.state_sha256(state),
        "skipped_steps": int(jax.device_get(state.skipped_steps)),
        "resumed_from": run.resumed_from,
        **{k: v for k, v in last_eval.items() if k != "step"},
    }
    baseline = run.data_info.get("unigram_baseline")
    if baseline is not None:
        summary["unigram_baseline"] = baseline
        summary["data_fingerprint"] = run.data_info["fingerprint"]
        if "eval/loss" in summary:
            run.progress.message(f"jtrain: final eval loss {summary['eval/loss']:.4f} nats/byte "
                                 f"vs unigram baseline {baseline:.4f}")
    if jax.process_index() == 0:
        with open(os.path.join(run.workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2, sort_keys=True)
    return summary
