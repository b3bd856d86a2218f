"""`train()`: the one engine behind the CLI and the library.

On one page (`train_and_evaluate`, which the train command calls directly and `train()`
calls with what a Python caller passed), in data-flow order: the config resolved once (a
torch DataLoader's settings included), the data handed over once (jtrain.data.prepare),
build (model, mesh, optimizer, abstract state, shardings, jitted steps), restore-or-init,
the outputs (observe.outputs: config.json, run.json, writers, header), the loop, the
summary. Each piece lives in the module that owns it; this file only connects them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from typing import Any, Callable, Sequence

import jax
from flax import linen as nn

from jtrain import checkpoint, internals, multihost
from jtrain import config as config_lib
from jtrain import control as control_lib
from jtrain import data as data_lib
from jtrain.data import tokens
from jtrain import mesh as mesh_lib
from jtrain import precision as precision_lib
from jtrain import state as state_lib
from jtrain import step as step_lib
from jtrain.control import decide as decide_lib
from jtrain.control import faults as faults_lib
from jtrain.control import rule as rule_lib
from jtrain.control import ledger as ledger_lib
from jtrain.control import watchdog as watchdog_lib
from jtrain.engine import async_eval, lm_tasks
from jtrain.engine import loop as loop_lib
from jtrain.engine import summary as summary_lib
from jtrain.checkpoint import store
from jtrain.checkpoint.store import check_workdir
from jtrain.engine import own_step
from jtrain.engine.assemble import (LOSS_SOURCE_KEY, MODEL_SOURCE_KEY, Build, build,  # noqa: F401
                                    check_run, model_sample)
from jtrain.errors import NonFiniteError, RestoreError, WorkdirError
from jtrain.observe import compiles as compiles_lib, goodput as goodput_lib
from jtrain.observe import layout, outputs as outputs_lib
from jtrain.observe import startup as startup_lib
from jtrain.observe import writers as writers_lib
from jtrain.observe.console import say
from jtrain.redact import redact


@dataclasses.dataclass
class TrainResult:
    """What `jtrain.train` returns: the final state and what the run recorded.

    Attributes:
        state: the final `TrainState` (on the devices, in its shardings).
        history: one entry per evaluation, `{"step": s, "eval/<metric>": v, ...}`.
        summary: what `summary.json` holds: the final step and eval metrics,
            `state_sha256`, `best_step` / `best_value`, `stopped_by` / `stop_reason`,
            `resumed_from`, `skipped_steps`, throughput and goodput.
        train_history: `{"step": s, "train/loss": v, ...}` at this session's log steps.
        stopped_by: None when the run reached `total_steps`; else "SIGTERM", "SIGINT",
            "early_stop" or "on_eval" (the run can be resumed).

    Examples:
        ```python
        result = jtrain.train(config, "runs/a", train_data=train_data)
        print(result.summary["state_sha256"], result.stopped_by)
        for record in result.history:
            print(record["step"], record["eval/loss"])
        ```
    """
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
          on_eval: Callable[[int, dict], bool] | None = None,
          allow_changes: Sequence[str] = (), step=None, callbacks: Sequence = (),
          tx=None) -> TrainResult:
    """Train `model` on `train_data`. Resumes from the newest checkpoint in `workdir`.

    A run that already finished is not run again: its stored result comes back. Every
    argument but `config` and `workdir` is optional; what is not given comes from the
    config (a built-in model from `model.*`, data from `data.*`).

    Args:
        config: a partial config (a dict or `ConfigDict` with only the keys you set): the
            schema fills the rest, and an unknown key or bad value is a `ConfigError`
            naming it (docs/reference/config.md).
        workdir: the run's directory (created; every file of the run lives there).
        model: a Flax NNX module, its class or a function `rngs -> module`; a Flax Linen
            module; a pure `(init, apply)` pair; None for the built-in `model.name`.
        train_data: arrays or an `(inputs, targets)` tuple, a map-style dataset (a torch
            `Dataset`, a list), a stream (`IterableDataset`, grain), a torch
            `DataLoader` or a `jtrain.data.Mixture`; None: `data.source` / `data.name`.
        eval_data: the same kinds; every example is scored once per evaluation.
        loss_fn: `loss_fn(outputs, batch)` returning `(loss_sum, weight_sum)` (exact
            token weighting) or a scalar mean; default: cross-entropy for int targets,
            mean squared error for float targets (`jtrain.losses.default_loss`).
        on_eval: `on_eval(step, metrics) -> bool`, called on process 0 after every
            evaluation with the globally reduced metrics; True stops the run there
            (checkpointed, on every process; `stopped_by == "on_eval"`).
        callbacks: run-control rules of your own (`jtrain.control.Rule`: `after_step`,
            `after_log`, `after_eval` returning a `jtrain.control.Action` to stop, scale
            the learning rate, log `callback/*` scalars or save the step; `state` /
            `restore` for resume), consulted after the built-in ones and before
            `control.callbacks` of the config.
        allow_changes: config keys (fnmatch patterns) that may differ from the
            checkpoint's when resuming (added to `checkpoint.allow_changes`).
        step: a step of your own (`jtrain.step.Step`: init, update, evaluate) in place of
            the built-in update (from a config: `step.factory`); `model` is then unused.
        tx: an `optax.GradientTransformation` used as the optimizer (its learning rate
            and schedule are its own; `train/lr` logs NaN). optim.* keys other than
            grad_accum_steps, trainable, frozen, lr_mults and ema must keep their
            defaults (a `ConfigError` names the first that would be ignored). Its state
            is checkpointed: a resume is exact when the same `tx` is passed again.

    Returns:
        The `TrainResult`: the final state, the eval history and `summary.json`.

    Raises:
        ConfigError: a bad config key or value, before any step.
        DataError: data the model or the loss cannot take, before any step.
        RestoreError: the workdir's checkpoint is of another config or model.

    Examples:
        ```python
        import numpy as np
        from flax import nnx
        import jtrain

        class Net(nnx.Module):
            def __init__(self, rngs: nnx.Rngs):
                self.linear = nnx.Linear(4, 3, rngs=rngs)

            def __call__(self, x):
                return self.linear(x)

        x = np.random.default_rng(0).normal(size=(256, 4)).astype(np.float32)
        y = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0).astype(np.int32)
        result = jtrain.train({"total_steps": 100, "data": {"batch_size": 32},
                               "optim": {"lr": 1e-2}},
                              "runs/net", model=Net, train_data=(x, y),
                              eval_data=(x[:64], y[:64]))
        print(result.summary["step"], result.summary["eval/accuracy"])
        ```
    """
    try:
        return train_and_evaluate(config, workdir,
                                  _Given(model, train_data, eval_data, loss_fn, step,
                                         tuple(callbacks), tx),
                                  on_eval=on_eval, allow_changes=allow_changes)
    except RestoreError as e:
        keys = getattr(e, "changed_keys", None)
        if not keys:
            raise
        raise RestoreError(f"{e.what}; to resume anyway pass jtrain.train(..., "
                           f"allow_changes={list(keys)!r}), or use a new workdir") from None


@dataclasses.dataclass
class _Given:
    """What a Python caller passed besides the config (None: built from the config)."""
    model: Any = None
    train_data: Any = None
    eval_data: Any = None
    loss_fn: Callable | None = None
    step: Any = None
    callbacks: tuple = ()  # run-control rules (jtrain.control.rule)
    tx: Any = None  # an optax GradientTransformation (train(tx=...))


def train_and_evaluate(config, workdir, given: _Given | None = None, *, on_eval=None,
                       allow_changes: Sequence[str] = (), resolved=None) -> TrainResult:
    """The run: resolve once, data, build, restore, loop, summary. `train()` for a Python
    caller (`given`: what it passed besides the config); the train command calls it
    directly, so its messages name command-line flags. `resolved`: `(cfg, notices)` from
    `config.resolve_for_run(config)` when the command resolved the config already (to
    report a bad key before waiting for its peers); the run then uses that object."""
    given, t_start = given or _Given(), time.perf_counter()
    control_lib.signals.freeze_heap_at_exit()
    if not store.is_remote(workdir):
        return _train_and_evaluate(config, _checked_workdir(workdir), given, on_eval,
                                   allow_changes, resolved, t_start, None)
    check_workdir(workdir)  # s3:// or gs://: a staging copy mirrored to the bucket
    if jax.process_count() > 1:
        raise WorkdirError(workdir, "a workdir on an object store is for single-process "
                           "runs; use a mounted path (e.g. gcsfuse) for several processes")
    mirror = store.Mirror(workdir, owner=True, say=say, skip=(tokens.CACHE,))
    try:
        mirror.pull()
        try:
            return _train_and_evaluate(config, mirror.local, given, on_eval,
                                       allow_changes, resolved, t_start, mirror)
        except BaseException:
            with contextlib.suppress(Exception):  # train.log and summary.json of a halt
                mirror.push()
            raise
    finally:
        mirror.close()


def _train_and_evaluate(config, workdir: str, given: _Given, on_eval, allow_changes,
                        resolved, t_start: float, mirror) -> TrainResult:
    startup = startup_lib.Startup(compiles_lib.Recorder())
    # Resolved once: a data.source factory runs and a torch DataLoader's settings become
    # data.* inside that resolution (run.json records them as decided).
    user_data = data_lib.UserData(given.train_data, given.eval_data, processes=_processes)
    with startup.phase("data"):
        cfg, notices = _resolve_once(config, allow_changes, user_data, resolved)
    determinism = precision_lib.set_deterministic(cfg.determinism.gpu_ops)
    # Before this run's first compile (JAX decides at a compile whether the cache is used).
    startup.cache_dir = compiles_lib.configure_cache(cfg.compile.cache_dir,
                                                     cfg.compile.cache_max_gb)
    # From here on SIGTERM / SIGINT mean: save the current step (if any), stop, return
    # (jtrain.control.signals); one that came during the CLI's imports is taken over.
    # JAX's cache writer and eviction are jtrain's until the run returns.
    with control_lib.Stopper(cfg.checkpoint.grace_seconds) as stopper, startup.recorder, \
            internals.compile_cache_patches():
        config_lib.validate(cfg, num_devices=jax.device_count())
        async_eval.check(cfg, remote=mirror.uri if mirror is not None else None,
                         mixture=isinstance(user_data.train, data_lib.Mixture),
                         from_python=tuple(  # what an evaluator process cannot rebuild
                             name for name in ("model", "train_data", "eval_data", "loss_fn",
                                               "step", "tx")
                             if getattr(given, name) is not None))
        faults_lib.arm_plan(cfg, workdir, jax.process_index(), jax.process_count(),
                            publish=mirror.upload if mirror is not None else None)
        if jax.process_index() == 0:  # a writer that cannot start: one line, no step run
            writers_lib.check(workdir, cfg.log)
        # Every process: the same config hash, device count and jtrain version.
        multihost.preflight.run(cfg, config_lib.config_hash(cfg))
        with _watchdog(cfg, workdir) as watchdog, _joins_precompile(startup):
            from_python = given.step if given.step is not None else (
                given.model if isinstance(given.model, step_lib.Step) else None)
            user_step = from_python if from_python is not None else (
                own_step.load(cfg.step) if cfg.step.factory else None)
            callbacks = rule_lib.users(given.callbacks, cfg.control.callbacks)
            with startup.phase("data"):  # checked: a DataError before any step
                data = data_lib.prepare(
                    cfg.data, user_data, seed=cfg.seed, eval_batch_size=cfg.eval.batch_size,
                    model_cfg=cfg.model if given.model is None and cfg.model.name != "user"
                    and user_step is None else None, gather=mesh_lib.process_values,
                    cache=workdir)
            with startup.phase("build"):
                b = build(cfg, sample=model_sample(cfg, data.train_example),
                          eval_example=data.example, model=given.model,
                          loss_fn=given.loss_fn, byte_level=data.byte_level,
                          train_example=data.train_example, step=user_step,
                          tx=given.tx)
                check_run(cfg, b, data)
                scorer = lm_tasks.for_run(cfg, b, data)
            _precompile(cfg, b, data, startup)
            with startup.phase("state"):  # newest checkpoint, else init_from, else fresh
                ckpt = checkpoint.open_checkpoints(workdir, cfg, data.info, mirror=mirror)
                start = ckpt.restore_or_init(b.abstract_with_shardings(), b.init)
                async_evals = async_eval.for_run(cfg, workdir, ckpt, start.step)
            ledger = goodput_lib.Ledger(workdir, t_start=t_start, startup=startup,
                                        first_step=start.step or 0,
                                        primary=jax.process_index() == 0)
            with startup.phase("data"):
                train_iter = data.train_iterator(start.data_state, functools.partial(
                    mesh_lib.host_to_device, mesh=b.mesh))
            with startup.phase("writers"):  # config.json, run.json, writers, header
                out = outputs_lib.open_outputs(cfg, workdir, build=b, data=data, start=start,
                    record=outputs_lib.run_record(
                        model_name=None if given.model is None and from_python is None
                        else b.model_name,
                        loss_fn=given.loss_fn, decided={**data.decided, **b.decided},
                        tx=given.tx),
                    run_ids=control_lib.writer_run_ids(start.control),
                    determinism=determinism, t_start=t_start,
                    shown=mirror.uri if mirror is not None else None)
            ckpt.control.writer_run_ids = out.writer.run_ids()  # reused on resume
            run = loop_lib.Run(
                workdir=workdir, build=b, state=start.state, data=data, train_iter=train_iter,
                ckpt=ckpt, out=out, resumed_from=start.step, watchdog=watchdog,
                decisions=_decisions(cfg, workdir, ckpt.control, start, data, train_iter,
                                     on_eval, out.progress.message, callbacks),
                stopper=stopper, startup=startup, goodput=ledger, record=out.record,
                async_evals=async_evals, lm_tasks=scorer)
            for line in notices:  # after the header: e.g. a warmup shortened for a short run
                out.progress.message(f"jtrain: note: {line}")
            # Steps trace under the mesh and the logical-axis rules, so models' activation
            # constraints (nn.with_logical_constraint) resolve to this mesh.
            with contextlib.closing(run), jax.set_mesh(b.mesh), \
                    nn.logical_axis_rules(mesh_lib.LOGICAL_RULES):
                if async_evals is not None:  # config.json is written: it can read the run
                    async_evals.start()
                try:
                    state, session = loop_lib.run_loop(cfg, run)
                except NonFiniteError as e:  # exit 4: its line in train.log and summary.json
                    summary_lib.record_halt(run, e)
                    raise
                summary = summary_lib.summarize(cfg, run, state, session)
                history = session.history
                if session.stored is not None:  # finished before: the stored result, and
                    stored = list(ckpt.control.eval_history)  # async evals recorded after
                    history = stored + [e for e in history  # its last save
                                        if not stored or e["step"] > stored[-1]["step"]]
            if mirror is not None:  # summary.json, the last lines of train.log
                mirror.push()
            return TrainResult(state=state, history=history, summary=summary,
                               train_history=session.train_history)


def _checked_workdir(workdir) -> str:
    if workdir is None:
        raise ValueError("workdir: required (the run's identity: checkpoints, logs, summary)")
    check_workdir(str(workdir))
    layout.check_folders(str(workdir))
    return os.path.abspath(workdir)


def _resolve_once(config, allow_changes, user_data, resolved):
    """(cfg, notices): the config resolved, with a DataLoader's settings in it. Given the
    command's resolution, that object is the run's; only a data.source factory that
    returns a torch DataLoader adds its settings to it (a second resolution, on top)."""
    if isinstance(config, dict) or hasattr(config, "to_dict"):
        redact(config)  # its secrets known before a data.source factory can echo them
    if resolved is None:
        cfg, notices = config_lib.resolve_for_run(config, allow_changes,
                                                  data_settings=user_data.settings)
    else:
        cfg, notices = resolved
        overrides = user_data.settings(cfg.data)
        if overrides:
            cfg = config_lib.resolve(cfg, data_settings=lambda _: overrides)
    redact(cfg)  # its secrets are known to the redactor before any line can echo them
    return cfg, notices


@contextlib.contextmanager
def _joins_precompile(startup: startup_lib.Startup):
    """No exit while XLA compiles the step in a thread (compile.precompile)."""
    try:
        yield
    except BaseException:
        if startup.precompile is not None:
            startup.precompile.join()
        raise


def _processes() -> tuple[int, int]:
    return jax.process_index(), jax.process_count()


def _watchdog(cfg, workdir: str) -> control_lib.Watchdog:
    """A step, eval or save past watchdog.timeout_s ends the process (exit 5) with the
    stacks in WORKDIR/hang.log; start-up (compile included) gets first_timeout_s."""
    return control_lib.Watchdog(
        control_lib.effective_timeout(cfg.watchdog.timeout_s, jax.process_count()),
        cfg.watchdog.first_timeout_s, log_path=os.path.join(workdir, watchdog_lib.LOG_FILE),
        process_index=jax.process_index())


def _precompile(cfg, b: Build, data, startup) -> None:
    """compile.precompile: the step compiles beside the state's init; its first call
    reuses the executable. Not with LoRA or model.quant: qwix patches JAX functions
    process-wide for each traced call, and the state's init and the step's compile tracing
    adapted models on two threads at once raced on that patch (KeyError
    'jax.numpy.asarray.__code__')."""
    if cfg.compile.precompile and not cfg.finetune.lora.rank and cfg.model.quant == "none":
        startup.precompile = compiles_lib.precompile(
            b.train_step, b.abstract_with_shardings(),
            compiles_lib.abstract_batch(data.train_example, cfg.data.batch_size,
                                        mesh_lib.batch_sharding(b.mesh)), mesh=b.mesh)


def _decisions(cfg, workdir, record, start, data, train_iter, on_eval, say, callbacks):
    """The loop's decisions (control.decide), continuing the restored record."""
    ledger = ledger_lib.Ledger(workdir, record.skip_ledger,
                                primary=jax.process_index() == 0, resumed_step=start.step)
    # From the data position of the next step's batch.
    batch_of, indices_of = data.batch_positions(train_iter.get_state(),
                                                (start.step or 0) + 1)
    return decide_lib.Decisions(cfg, record, ledger=ledger, on_eval=on_eval,
                                 batch_of=batch_of, indices_of=indices_of, say=say,
                                 callbacks=callbacks)
