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
from jtrain import loop as loop_lib
from jtrain import config as config_lib
from jtrain import control as control_lib
from jtrain.control import decide as decide_lib
from jtrain.control import ledger as ledger_lib
from jtrain.control import memory as memory_lib
from jtrain.control import watchdog as watchdog_lib
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
from jtrain.errors import ConfigError
from jtrain.observe.redact import redact


@dataclasses.dataclass
class TrainResult:
    state: state_lib.TrainState
    history: list[dict[str, float]]  # one entry per evaluation: {"step": s, "eval/...": v}
    summary: dict[str, Any]  # = summary.json: final metrics, best_step / best_value,
    #                          stopped_by / stop_reason, skipped_steps, perf
    train_history: list[dict[str, float]] = dataclasses.field(default_factory=list)
    # ^ {"step": s, "train/loss": v, ...} at this session's log steps

    @property
    def stopped_by(self) -> str | None:  # None: ran to total_steps
        return self.summary.get("stopped_by")


def train(config=None, workdir: str | None = None, *, model=None, train_data=None,
          eval_data=None, loss_fn: Callable | None = None,
          on_eval: Callable[[int, dict], bool] | None = None) -> TrainResult:
    """Train `model` (built-in from config.model if None) on `train_data` (built-in from
    config.data if None). Resumes from the newest checkpoint in `workdir`.

    `loss_fn(outputs, batch)` returns `(loss_sum, weight_sum)` (exact token weighting)
    or a scalar mean; default: cross-entropy for int targets, MSE for float targets.
    `on_eval(step, metrics) -> bool`: called on process 0 after every evaluation with the
    globally reduced metrics; True stops the run there (checkpointed, on every process).
    """
    if workdir is None:
        raise ValueError("workdir: required (the run's identity: checkpoints, logs, summary)")
    _check_workdir(os.path.abspath(workdir))
    cfg = config_lib.resolve(config)
    determinism = precision_lib.set_deterministic(cfg.deterministic)
    # From here on SIGTERM / SIGINT mean: save the current step (if any), stop, return
    # (jtrain.control.signals); one that came during the CLI's imports is taken over.
    with control_lib.Stopper(cfg.checkpoint.grace_seconds) as stopper:
        # data.source factories run, and a torch DataLoader's settings become data.*,
        # before the batch is checked against the devices.
        train_data, eval_data, overrides = data_lib.load_user_data(
            cfg.data, train_data, eval_data, process_index=jax.process_index(),
            process_count=jax.process_count())
        if overrides:  # a new config: a validated one is never changed in place
            cfg = config_lib.resolve({**cfg.to_dict(),
                                      "data": {**cfg.data.to_dict(), **overrides}})
        config_lib.validate(cfg, num_devices=jax.device_count())
        # A step, eval or save past watchdog.timeout_s ends the process (exit 5) with the
        # stacks in WORKDIR/hang.log; start-up (compile included) gets first_timeout_s.
        watchdog = control_lib.Watchdog(
            control_lib.effective_timeout(cfg.watchdog.timeout_s, jax.process_count()),
            cfg.watchdog.first_timeout_s, log_path=os.path.join(
                os.path.abspath(workdir), watchdog_lib.LOG_FILE),
            process_index=jax.process_index())
        with watchdog:
            return _train(cfg, workdir, model, train_data, eval_data, loss_fn, on_eval,
                          determinism, watchdog, stopper)


def _check_workdir(path: str) -> None:
    """A ConfigError naming the workdir when it cannot be a run's directory."""
    parent = path
    while not os.path.exists(parent):  # the nearest existing ancestor must be writable
        parent = os.path.dirname(parent)
    if parent == path and not os.path.isdir(path):
        raise ConfigError("workdir", f"{path} is a file, not a directory")
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError("workdir", f"{parent} is not writable (the run writes its "
                                     "checkpoints and logs there)")


def _train(cfg, workdir, model, train_data, eval_data, loss_fn, on_eval, determinism,
           watchdog, stopper) -> TrainResult:
    run = _setup(cfg, os.path.abspath(workdir), model, train_data, eval_data, loss_fn,
                 on_eval, determinism, watchdog)
    run.stopper = stopper
    try:
        # Steps trace under the mesh and the logical-axis rules, so models' activation
        # constraints (nn.with_logical_constraint) resolve to this mesh.
        with jax.set_mesh(run.build.mesh), nn.logical_axis_rules(mesh_lib.LOGICAL_RULES):
            state, session = loop_lib.run_loop(cfg, run)
            summary = loop_lib.summarize(cfg, run, state, session)
        return TrainResult(state=state, history=session.history, summary=summary,
                           train_history=session.train_history)
    finally:
        run.close()


MODEL_SOURCE_KEY = "model_source"  # in config.json only: how the run got its model


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
    memory_plan: Any = None  # control.memory.Plan when a budget was given, else None
    trainable: dict | None = None  # optim.trainable_split: {"train"|"frozen": (leaves, n)}

    def init(self) -> state_lib.TrainState:
        return state_lib.init_state(self.model_fns, self.tx, self.policy, self.sample_inputs,
                                    self.mesh, self.seed, self.shardings)

    def abstract_with_shardings(self):
        """What orbax restores into."""
        return checkpoint.abstract_with_shardings(self.abstract, self.shardings)


def build(cfg, *, sample, eval_example: dict, model=None, loss_fn: Callable | None = None,
          byte_level: bool = False, eval_defaults: bool = False,
          train_example: dict | None = None) -> Build:
    """Model, mesh, optimizer, abstract state and shardings, jitted steps: the set-up that
    training, `python -m jtrain.evaluate` and the benchmarks share. `sample`: one example's
    inputs (any pytree of arrays), `eval_example`: one eval example (for its targets).
    `eval_defaults`: the task's default metrics on top of `eval.metrics` (the report).
    `train_example`: one training example; with a memory budget (control.memory) the
    step's grad_accum_steps is planned from it."""
    mesh = mesh_lib.make_mesh(cfg.mesh)
    policy = precision_lib.make_policy(cfg.model)
    if model is None and cfg.model.name == "user":  # model.factory: treated as passed in
        model = models_lib.make_model(cfg.model, dtype=policy.compute_dtype,
                                      param_dtype=policy.param_dtype)
    module = model if model is not None else models_lib.make_model(
        cfg.model, dtype=policy.compute_dtype, param_dtype=policy.param_dtype)
    model_fns = adapters.to_model_fns(module, mesh)
    name = cfg.model.name if model is None else f"user {_model_name(model, model_fns)}"
    if model is not None:  # your model computes in the policy's dtype (precision.py)
        model_fns = dataclasses.replace(model_fns, apply=precision_lib.cast_apply(
            model_fns.apply, policy, tuple(cfg.model.keep_fp32)))
    tx, schedule = optim_lib.make_optimizer(cfg.optim, cfg.total_steps)
    sample_inputs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        (cfg.data.batch_size,) + np.shape(x), np.asarray(x).dtype), sample)
    abstract, shardings = state_lib.make_abstract_state(
        model_fns, tx, policy, sample_inputs, mesh, cfg.seed)
    split = None
    if cfg.optim.trainable or cfg.optim.frozen or cfg.optim.lr_mults:
        try:  # regexes that match no parameter are typos: said before the first step
            split = optim_lib.trainable_split(abstract.params, cfg.optim)
        except ValueError as e:
            key, why = str(e).split(": ", 1)
            raise ConfigError(key, why) from None

    batch_sharding, repl = mesh_lib.batch_sharding(mesh), mesh_lib.replicated(mesh)
    valid_fn = data_lib.load_named(cfg.data.valid_fn, "data.valid_fn") \
        if cfg.data.valid_fn else None
    def make_train_step(accum):
        return jax.jit(
            step_lib.make_train_step(
                model_fns.apply, loss_fn or losses.default_loss, tx, schedule,
                grad_accum_steps=accum, dynamic_loss_scale=policy.dynamic_loss_scale,
                halt_on_nonfinite=cfg.nonfinite.policy == "halt",
                max_consecutive=cfg.nonfinite.max_consecutive, valid_fn=valid_fn),
            in_shardings=(shardings, batch_sharding), out_shardings=(shardings, repl),
            donate_argnums=0)

    memory_plan = _plan_memory(cfg, mesh, make_train_step, abstract, train_example)
    train_step = make_train_step(memory_plan.accum if memory_plan
                                 else cfg.optim.grad_accum_steps)
    eval_spec = eval_loop.make_spec(cfg.eval, model_fns.apply, abstract.params, sample_inputs,
                                    eval_example, byte_level=byte_level,
                                    with_defaults=eval_defaults)
    eval_step = jax.jit(step_lib.make_eval_step(model_fns.apply, loss_fn or losses.default_loss,
                                                user_loss=loss_fn is not None,
                                                metrics=eval_spec),
                        in_shardings=(shardings.params, batch_sharding),
                        out_shardings=(repl, batch_sharding, repl))
    return Build(mesh, policy, model_fns, name, model, tx, schedule, sample_inputs, abstract,
                 shardings, eval_spec, train_step, eval_step, cfg.seed, memory_plan, split)


def _model_name(model, model_fns) -> str:
    """The class of the user's model, also when a function built it (NNX rngs -> module)."""
    if model_fns.nnx_graph is not None:
        built = getattr(model_fns.nnx_graph.graphdef.nodes[0], "type", None)
        if isinstance(built, type):
            return built.__name__
    if isinstance(model, tuple):
        return "(init, apply)"
    return model.__name__ if isinstance(model, type) else type(model).__name__


def _plan_memory(cfg, mesh, make_train_step, abstract, train_example):
    """control.memory's plan when a budget is known and a train example given, else None."""
    budget, source = memory_lib.device_budget(cfg.memory.budget_bytes,
                                              mesh.devices.flat[0])
    if budget is None or train_example is None:
        return None
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        (cfg.data.batch_size,) + np.shape(x), np.asarray(x).dtype), train_example)

    def measure(accum):
        return memory_lib.step_bytes(make_train_step(accum).lower(abstract, batch).compile())

    return memory_lib.plan(measure, per_device_batch=cfg.data.batch_size
                           // mesh_lib.data_parallel_size(mesh),
                           configured=cfg.optim.grad_accum_steps, budget=budget,
                           source=source)


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


def _setup(cfg, workdir, model, train_data, eval_data, loss_fn, on_eval,
           determinism, watchdog) -> loop_lib.Run:
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
              model=model, loss_fn=loss_fn, byte_level=data_info.get("name") == "pystdlib",
              train_example=train_src[0])
    # Config values that would make the run wrong, found before the first step.
    terms = eval_loop.loss_term_names(b.model_fns.apply, loss_fn, b.abstract.params,
                                      (eval_src if eval_src is not None else train_src)[0])
    decide_lib.check_monitors(cfg, None if eval_src is None
                               else eval_loop.metric_keys(b.eval_spec, terms))
    if b.user_model is None:
        data_lib.check_vocab(cfg.model, train_src)
    eval_loop.check_targets(
        b.eval_spec, eval_loop.output_shape_of(b.model_fns.apply, b.abstract.params,
                                               b.sample_inputs),
        {"train_data": train_src, **({"eval_data": eval_src} if eval_src is not None else {})},
        default_loss=loss_fn is None)

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
        # A model object passed from Python cannot be rebuilt from the config: say which
        # (jtrain.evaluate reads this key and explains; model.factory makes it rebuildable).
        source = {} if model is None else {MODEL_SOURCE_KEY: f"python: {b.model_name}"}
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(redact({**resolved, **source}), f, indent=2, sort_keys=True,
                      default=str)
    writer = writers_lib.MetricWriter(workdir, cfg.log, is_primary=primary,
                                      run_ids=control_lib.writer_run_ids(start.control),
                                      resumed_step=start.step)
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
    header = _header(cfg, b, data_info, (train_src, eval_src), workdir, start.step, flops, peak,
                     determinism)
    progress.message(header)
    writer.write_text(start.step or 0, "run/header", header)  # TensorBoard's text tab
    progress.message(header_lib.parameter_table(b.abstract.params), level=2)
    meter = perf_lib.Meter(start_step=start.step or 0, global_batch=cfg.data.batch_size,
                           flops_per_example=flops, peak_flops=peak,
                           num_devices=jax.device_count(), t_start=t_start)
    profiler = perf_lib.Profiler(cfg.profile, workdir, is_primary=primary)
    decisions = _decisions(cfg, workdir, ckpt.control, start, train_iter, on_eval,
                           progress.message)
    return loop_lib.Run(workdir, b, start.state, train_iter, eval_src, data_info, ckpt,
                        _Outputs(writer, progress, meter, profiler), start.step, decisions,
                        watchdog, determinism)


def _decisions(cfg, workdir, record, start, train_iter, on_eval, say):
    """The loop's decisions (control.decide), continuing the restored record."""
    ledger = ledger_lib.Ledger(workdir, record.skip_ledger,
                                primary=jax.process_index() == 0, resumed_step=start.step)
    first_state = train_iter.get_state()  # the data position of the next step's batch
    position, first_step = first_state.get("position"), (start.step or 0) + 1

    def batch_of(step):  # the global batch number a step consumed (map-style data)
        return None if position is None else int(position) + step - first_step

    def indices_of(number):
        return data_lib.example_indices(first_state, cfg.seed, number)

    return decide_lib.Decisions(cfg, record, ledger=ledger, on_eval=on_eval,
                                 batch_of=batch_of, indices_of=indices_of, say=say)


def _header(cfg, b: Build, data_info, sources, workdir, resumed_from, flops, peak,
            determinism=None) -> str:
    train_src, eval_src = sources
    extra = []
    if "fingerprint" in data_info:
        extra.append(f"jtrain: corpus sha256 {data_info['fingerprint'][:16]}..., "
                     f"{data_info['num_bytes']:,} bytes from {data_info['num_files']} files")
    extra += [f"jtrain: data: {note}" for note in data_info.get("notes", ())]
    mfu = f"MFU vs peak {peak:.3g} FLOP/s/device" if peak else "MFU n/a (set perf.peak_flops)"
    if determinism:
        extra.append(f"jtrain: {determinism}")
    if b.trainable is not None and b.trainable["frozen"][0]:
        (tl, tn), (fl, fn) = b.trainable["train"], b.trainable["frozen"]
        extra.append(f"jtrain: trainable {tn:,} params in {tl} leaves; frozen {fn:,} in "
                     f"{fl} leaves (optim.trainable / optim.frozen)")
    if b.memory_plan is not None:
        extra.append(f"jtrain: {b.memory_plan.describe()}")
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
