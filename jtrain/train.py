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
import re
import tempfile
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import linen as nn

from jtrain import checkpoint, eval_loop
from jtrain import loop as loop_lib
from jtrain import summary as summary_lib
from jtrain import config as config_lib
from jtrain import control as control_lib
from jtrain.control import decide as decide_lib
from jtrain.control import ledger as ledger_lib
from jtrain.control import watchdog as watchdog_lib
from jtrain import data as data_lib
from jtrain import mesh as mesh_lib
from jtrain import multihost
from jtrain.observe import perf as perf_lib
from jtrain import precision as precision_lib
from jtrain import state as state_lib
from jtrain.observe import compiles as compiles_lib, console, header as header_lib
from jtrain.observe import startup as startup_lib
from jtrain.observe import writers as writers_lib
from jtrain.errors import NonFiniteError, RestoreError, WorkdirError
from jtrain.redact import redact
from jtrain.build import LOSS_SOURCE_KEY, MODEL_SOURCE_KEY, Build, build, model_sample  # noqa: F401


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
          on_eval: Callable[[int, dict], bool] | None = None,
          allow_changes: Sequence[str] = ()) -> TrainResult:
    """Train `model` (built-in from config.model if None) on `train_data` (built-in from
    config.data if None). Resumes from the newest checkpoint in `workdir`; a run that
    already finished is not run again: its stored result comes back.

    `loss_fn(outputs, batch)` returns `(loss_sum, weight_sum)` (exact token weighting)
    or a scalar mean; default: cross-entropy for int targets, MSE for float targets.
    `on_eval(step, metrics) -> bool`: called on process 0 after every evaluation with the
    globally reduced metrics; True stops the run there (checkpointed, on every process).
    `allow_changes`: config keys (fnmatch patterns) that may differ from the checkpoint's
    when resuming (added to checkpoint.allow_changes).
    """
    try:
        return _entry(config, workdir, model, train_data, eval_data, loss_fn, on_eval,
                      allow_changes)
    except RestoreError as e:
        keys = getattr(e, "changed_keys", None)
        if not keys:
            raise
        what = str(e).split("; to resume anyway", 1)[0]
        raise RestoreError(f"{what}; to resume anyway pass jtrain.train(..., "
                           f"allow_changes={list(keys)!r}), or use a new workdir") from None


def run_from_cli(config, workdir: str) -> TrainResult:
    """`train` for `python -m jtrain.main`: its messages name command-line flags."""
    return _entry(config, workdir, None, None, None, None, None, ())


def _entry(config, workdir, model, train_data, eval_data, loss_fn, on_eval,
           allow_changes) -> TrainResult:
    if workdir is None:
        raise ValueError("workdir: required (the run's identity: checkpoints, logs, summary)")
    check_workdir(str(workdir))
    cfg, notices = config_lib.resolve_for_run(config, allow_changes=allow_changes)
    redact(cfg)  # its secrets are known to the redactor before any line can echo them
    determinism = precision_lib.set_deterministic(cfg.deterministic)
    # Before this run's first compile (JAX decides at a compile whether the cache is used).
    cache_dir = compiles_lib.configure_cache(cfg.compile.cache_dir, cfg.compile.cache_max_gb)
    recorder = compiles_lib.Recorder()
    startup = startup_lib.Startup(recorder)
    # From here on SIGTERM / SIGINT mean: save the current step (if any), stop, return
    # (jtrain.control.signals); one that came during the CLI's imports is taken over.
    with control_lib.Stopper(cfg.checkpoint.grace_seconds) as stopper, recorder:
        # data.source factories run, and a torch DataLoader's settings become data.*,
        # before the batch is checked against the devices.
        with startup.phase("data"):
            train_data, eval_data, overrides = data_lib.load_user_data(
                cfg.data, train_data, eval_data, process_index=jax.process_index(),
                process_count=jax.process_count())
        if overrides:  # a new config: a validated one is never changed in place
            cfg = config_lib.resolve({**cfg.to_dict(),
                                      "data": {**cfg.data.to_dict(), **overrides}})
        config_lib.validate(cfg, num_devices=jax.device_count())
        # Every process: the same config hash, device count and jtrain version.
        multihost.preflight.run(cfg, config_lib.config_hash(cfg))
        # A step, eval or save past watchdog.timeout_s ends the process (exit 5) with the
        # stacks in WORKDIR/hang.log; start-up (compile included) gets first_timeout_s.
        watchdog = control_lib.Watchdog(
            control_lib.effective_timeout(cfg.watchdog.timeout_s, jax.process_count()),
            cfg.watchdog.first_timeout_s, log_path=os.path.join(
                os.path.abspath(workdir), watchdog_lib.LOG_FILE),
            process_index=jax.process_index())
        with watchdog:
            return _train(cfg, workdir, model, train_data, eval_data, loss_fn, on_eval,
                          determinism, watchdog, stopper, notices,
                          loop_lib.Startup(startup, recorder, cache_dir))


_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def check_workdir(path: str) -> None:
    """A WorkdirError naming the workdir when it cannot be a run's directory: a remote
    URI (jtrain writes with local file I/O), a file, or not writable. Writing is tried (a
    file created and removed in the workdir, or in its nearest existing parent when it
    does not exist yet), not inferred from permission bits: root passes every os.access
    check, and a read-only file system fails only the write."""
    if _URI.match(path):
        raise WorkdirError(f"{path} is a remote URI; jtrain writes its run directory (logs, "
                           "metrics, checkpoints) with local file I/O: use a local or "
                           "mounted path (e.g. a gcsfuse or NFS mount)")
    path = parent = os.path.abspath(path)
    while not os.path.exists(parent):  # the nearest existing ancestor must be writable
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        where = "" if parent == path else f" (in {path})"
        raise WorkdirError(f"{parent} is a file, not a directory{where}; choose another "
                           "--workdir")
    try:
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as e:
        why = (e.strerror or str(e)).lower()
        raise WorkdirError(f"{parent} is not writable ({why}): the run writes its "
                           "checkpoints and logs there; choose another --workdir") from None


def _train(cfg, workdir, model, train_data, eval_data, loss_fn, on_eval, determinism,
           watchdog, stopper, notices, startup) -> TrainResult:
    run = _setup(cfg, os.path.abspath(workdir), model, train_data, eval_data, loss_fn,
                 on_eval, determinism, watchdog, startup)
    for line in notices:  # after the header: e.g. a warmup shortened for a short run
        run.out.progress.message(f"jtrain: note: {line}")
    run.stopper = stopper
    try:
        # Steps trace under the mesh and the logical-axis rules, so models' activation
        # constraints (nn.with_logical_constraint) resolve to this mesh.
        with jax.set_mesh(run.build.mesh), nn.logical_axis_rules(mesh_lib.LOGICAL_RULES):
            try:
                state, session = loop_lib.run_loop(cfg, run)
            except NonFiniteError as e:  # exit 4: its line in train.log and summary.json
                summary_lib.record_halt(run, e)
                raise
            summary = summary_lib.summarize(cfg, run, state, session)
        if session.stored is not None:  # finished before: the stored result, unchanged
            return TrainResult(state=state, history=list(run.ckpt.control.eval_history),
                               summary=summary, train_history=session.train_history)
        return TrainResult(state=state, history=session.history, summary=summary,
                           train_history=session.train_history)
    finally:
        run.close()


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
           determinism, watchdog, startup) -> loop_lib.Run:
    t_start = time.perf_counter()
    os.makedirs(workdir, exist_ok=True)
    phase = startup.startup.phase

    # Checked here (DataError before any step); the data's shapes come from a sample batch.
    with phase("data"):
        train_src, eval_src, data_info = data_lib.make_sources(
            cfg.data, train_data, eval_data, process_index=jax.process_index(),
            process_count=jax.process_count(), gather=mesh_lib.process_values)
        example = (eval_src if eval_src is not None else train_src)[0]
        sample = model_sample(cfg, train_src[0])  # example 0's inputs as the model sees
    with phase("build"):
        b = _build_and_check(cfg, sample, example, model, loss_fn, data_info, train_src,
                             eval_src)
    if cfg.compile.precompile:
        # The step compiles beside the state's init; its first call reuses the executable.
        startup.precompile = compiles_lib.precompile(
            b.train_step, b.abstract_with_shardings(),
            compiles_lib.abstract_batch(train_src[0], cfg.data.batch_size,
                                        mesh_lib.batch_sharding(b.mesh)), mesh=b.mesh)

    try:
        # Start-up precedence (jtrain.checkpoint.manager, WORKSPACE.md): (1) the newest
        # intact checkpoint in workdir/checkpoints; (2) else checkpoint.init_from; (3) else
        # fresh.
        with phase("state"):
            ckpt = checkpoint.Checkpointer(workdir, cfg, data_info)
            start = ckpt.restore_or_init(b.abstract_with_shardings(), b.init)
        with phase("data"):
            train_iter = _train_iterator(cfg, train_src, start, b.mesh)
        with phase("writers"):
            outputs = _outputs(cfg, b, workdir, model, loss_fn, start, ckpt, data_info,
                               (train_src, eval_src), sample, determinism, t_start)
    except BaseException:
        if startup.precompile is not None:  # no exit while XLA compiles in a thread
            startup.precompile.join()
        raise
    decisions = _decisions(cfg, workdir, ckpt.control, start, train_iter, on_eval,
                           outputs.progress.message)
    return loop_lib.Run(workdir, b, start.state, train_iter, eval_src, data_info, ckpt,
                        outputs, start.step, decisions, watchdog, determinism,
                        startup=startup)


def _build_and_check(cfg, sample, example, model, loss_fn, data_info, train_src,
                     eval_src) -> Build:
    b = build(cfg, sample=sample, eval_example=example,
              model=model, loss_fn=loss_fn, byte_level=data_info.get("name") == "pystdlib",
              train_example=train_src[0])
    # Config values that would make the run wrong, found before the first step.
    eval_loop.check_model_and_loss(
        b.model_fns.apply, b.loss_fn, b.abstract.params,
        {"train_data": train_src[0], **({"eval_data": eval_src[0]} if eval_src is not None
                                        else {})},
        model_inputs=tuple(cfg.data.model_inputs), model=b.model_name.removeprefix("user "))
    if b.loss_fn is None and "targets" not in example:
        raise data_lib.DataError(
            f"{'eval_data' if eval_src is not None else 'train_data'}[0]: no 'targets' field "
            f"(fields: {', '.join(sorted(map(str, example)))}); the default loss needs one: "
            "pass loss_fn(outputs, batch), or set loss.fn or loss.terms")
    terms = eval_loop.loss_term_names(b.model_fns.apply, b.loss_fn, b.abstract.params,
                                      example, tuple(cfg.data.model_inputs))
    decide_lib.check_monitors(cfg, None if eval_src is None
                               else eval_loop.metric_keys(b.eval_spec, terms))
    if b.user_model is None:
        data_lib.check_vocab(cfg.model, train_src)
    eval_loop.check_targets(
        b.eval_spec, eval_loop.output_shape_of(b.model_fns.apply, b.abstract.params,
                                               b.sample_inputs),
        {"train_data": train_src, **({"eval_data": eval_src} if eval_src is not None else {})},
        default_loss=b.loss_fn is None)
    return b


def _train_iterator(cfg, train_src, start, mesh):
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
    return data_lib.device_prefetch(
        train_iter, functools.partial(mesh_lib.host_to_device, mesh=mesh),
        cfg.data.device_prefetch)


def _outputs(cfg, b: Build, workdir, model, loss_fn, start, ckpt, data_info, sources,
             sample, determinism, t_start) -> _Outputs:
    """config.json, the metric writers, the progress display and the header."""
    primary = jax.process_index() == 0
    resolved = cfg.to_dict()
    if primary:
        # A model object passed from Python cannot be rebuilt from the config: say which
        # (jtrain.evaluate reads this key and explains; model.factory makes it rebuildable).
        source = {} if model is None else {MODEL_SOURCE_KEY: f"python: {b.model_name}"}
        if loss_fn is not None:
            source[LOSS_SOURCE_KEY] = f"python: {getattr(loss_fn, '__name__', 'loss_fn')}"
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
    header = _header(cfg, b, data_info, sources, workdir, start.origin, flops, peak,
                     determinism)
    progress.message(header)
    writer.write_text(start.step or 0, "run/header", header)  # TensorBoard's text tab
    progress.message(header_lib.parameter_table(b.abstract.params), level=2)
    meter = perf_lib.Meter(start_step=start.step or 0, global_batch=cfg.data.batch_size,
                           flops_per_example=flops, peak_flops=peak,
                           num_devices=jax.device_count(), t_start=t_start)
    profiler = perf_lib.Profiler(cfg.profile, workdir, is_primary=primary)
    return _Outputs(writer, progress, meter, profiler)


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


def _header(cfg, b: Build, data_info, sources, workdir, origin, flops, peak,
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
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(b.abstract.params))
    extra.append(header_lib.optimizer_line(cfg.optim, cfg.total_steps))
    extra.append(header_lib.trainable_line(n_params, len(jax.tree.leaves(b.abstract.params)),
                                           b.trainable))
    if b.memory_plan is not None:
        extra.append(f"jtrain: {b.memory_plan.describe()}")
    extra.append(f"jtrain: eval {b.eval_spec.task}: {', '.join(b.eval_spec.names)}; "
                 + (f"{flops:.3g} train FLOPs/example, {mfu}" if flops else "MFU n/a"))
    return header_lib.run_header(
        model=f"{b.model_name} ({b.model_fns.kind})", num_params=n_params,
        precision=b.policy.describe(), mesh_shape=dict(b.mesh.shape),
        data_name=str(data_info.get("name")), train_size=train_src.known_size,
        eval_size=len(eval_src) if eval_src is not None else 0,
        global_batch=cfg.data.batch_size, workdir=workdir, origin=origin,
        batches_per_epoch=data_info.get("batches_per_epoch"), extra=tuple(extra))
