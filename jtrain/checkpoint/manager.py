"""Checkpoints: a thin layer over orbax's CheckpointManager. Reads `config.checkpoint`.

One checkpoint = `WORKDIR/checkpoints/<step>/` with the items `state` (the TrainState),
`data` (the iterator position, JSON) and `control` (the run-control record,
`jtrain.control.RunControl`), and `jtrain_manifest.json` (size and CRC-32 of every file,
the state's tree spec), written last in the atomic commit (`jtrain.checkpoint.integrity`).

`Checkpointer.restore_or_init` follows the start-up precedence of
docs/reference/workdir.md: the newest intact checkpoint (damaged ones reported and moved
to checkpoints.damaged/, or exit 3 with checkpoint.strict_restore), else `init.path`,
else a fresh init (with checkpoint.local_dir, `jtrain.checkpoint.tiers` restores the
newer of two tiers). A changed config is refused unless `checkpoint.allow_changes`
matches it; a tree that differs from the model is never cast or reshaped (exit 3 naming
the leaf).

Saves are asynchronous: `save` returns once orbax has copied the arrays off the device;
a failed background write raises `CheckpointError` at the next save, `wait` or `close`,
and that step never gets a manifest. Retention uses orbax preservation policies (never
`best_fn` + `max_to_keep`, which deletes the newest checkpoint when it is not among the
best): latest `max_to_keep` (at least 1), multiples of `keep_every_steps`, the final
step, and the `keep_top_k` best by `monitor` in the run-control record's registry.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import threading
import time
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from jtrain import config as config_lib
from jtrain import control as control_lib
from jtrain.checkpoint import init_from as init_from_lib
from jtrain.checkpoint import integrity, policy
from jtrain.config import changes as changes_lib
from jtrain.control import faults
from jtrain.errors import CheckpointError, RestoreError, env_int, first_line
from jtrain.observe import runfiles
from jtrain.observe.console import say
from jtrain.redact import redact


class _Unreadable(Exception):
    """A checkpoint that passed our checks but that orbax cannot restore."""


@dataclasses.dataclass
class Start:
    """What `Checkpointer.restore_or_init` starts a run from.

    Attributes:
        state: the TrainState, restored or fresh.
        step: the checkpoint step resumed from; None for init_from or a fresh start.
        data_state: the data iterator's position to set when resuming, else None.
        source: "checkpoint", "init_from" or "fresh".
        control: the run-control record the checkpoint carried (monitors, eval history).
        origin: the header's start-up line: where the weights came from.

    Examples:
        ```python
        start = ckpt.restore_or_init(b.state_abstract, b.init)
        print(start.source, start.step, start.origin)   # e.g. checkpoint 200 resumed ...
        ```
    """
    state: Any
    step: int | None  # the checkpoint step resumed from; None for init_from / fresh
    data_state: dict | None  # the iterator position to set, if resuming
    source: str  # "checkpoint", "init_from" or "fresh"
    control: control_lib.RunControl
    origin: str = "fresh start"  # the header's start-up line: where the weights came from


class Checkpointer:
    """Saves and restores a run's checkpoints in `WORKDIR/checkpoints`.

    `config` is the resolved run config (its `checkpoint` subtree is read here; the rest
    is recorded and compared on resume). `data_info` describes the dataset.

    Examples:
        ```python
        from jtrain.checkpoint import Checkpointer

        ckpt = Checkpointer("runs/a", cfg)               # cfg: jtrain.resolve(...)
        start = ckpt.restore_or_init(b.state_abstract, b.init)
        state = start.state
        ...                                              # train
        ckpt.save(step, state, data_state={})
        ckpt.wait()                                      # the background write done
        ckpt.close()
        ```
    """

    def __init__(self, workdir: str, config, data_info: dict | None = None, *,
                 mirror=None, directory: str | None = None, keep: Any = None):
        """`mirror`: a workdir on an object store (checkpoint.store.Mirror); `directory`,
        `keep`: another tier's folder and orbax preservation policy
        (`jtrain.checkpoint.tiers`: the local tier, which keeps its newest step only)."""
        if not hasattr(config, "checkpoint"):
            raise TypeError("Checkpointer(workdir, run_config): it owns (and cleans up) "
                            "WORKDIR/checkpoints; for read-only access use CheckpointReader")
        self.directory = directory or os.path.join(os.path.abspath(workdir), "checkpoints")
        self.cfg = config.checkpoint
        self.init = config.init  # a new run's starting state (init.path)
        self.writer_nice = env_int(policy.WRITER_NICE_ENV, 19, 0, 19)  # not a config key
        self.mirror = mirror  # checkpoint.store.Mirror: a workdir on an object store
        self.held: set[int] = set()  # eval.mode=async: kept until their eval is applied
        resolved = redact(config.to_dict())
        self.control = control_lib.RunControl(
            # the hash of what is stored: a hash of the secrets would confirm a guess
            config=resolved, config_sha256=config_lib.config_hash(resolved),
            data_info=dict(data_info or {}), versions=control_lib.versions())
        self._restore_step = self._select()  # sanitize, then pick before orbax looks
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=True,  # sync saves = save + wait
            async_options=ocp.AsyncOptions(post_finalization_callback=self._seal),
            cleanup_tmp_directories=False,  # done by _select, which never follows symlinks
            preservation_policy=keep or policy.KeepPolicy(self),
            create=True,
        )
        self._mngr = ocp.CheckpointManager(self.directory, options=options,
                                           item_handlers=_item_handlers())
        self._inflight: tuple[int, dict] | None = None  # (step, tree spec) being written
        self._last_save = time.monotonic()

    # -- choosing what to restore -------------------------------------------------------
    def _select(self) -> int | None:
        """Process 0 cleans up and finds the newest intact step; all processes agree."""
        step, error = None, ""
        if jax.process_index() == 0:
            try:
                step = self._select_local()
            except RestoreError as e:
                error = str(e)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            code = -2 if error else (-1 if step is None else step)
            code = int(multihost_utils.broadcast_one_to_all(np.int64(code)))
            if code == -2:
                raise RestoreError(error or "checkpoint restore failed on process 0")
            step = None if code == -1 else code
        if error:
            raise RestoreError(error)
        return step

    def _select_local(self) -> int | None:
        strict = self.cfg.strict_restore
        steps, unfinished, suspicious = integrity.scan(self.directory)
        for path in unfinished:
            say(f"warning: {path}: an unfinished save (killed while writing); removed")
            integrity.remove_unfinished(path)
        for path in suspicious:
            self._damaged(integrity.suspicious_problem(path), path, strict,
                          older=bool(steps))
        for i in reversed(range(len(steps))):
            path = os.path.join(self.directory, str(steps[i]))
            problem = integrity.check_step(path, steps[i])
            if problem is None:
                return steps[i]
            self._damaged(problem, path, strict, older=i > 0)
        return None

    def _damaged(self, problem: str, path: str, strict: bool, older: bool = True) -> None:
        if strict:
            raise RestoreError(f"damaged checkpoint: {problem} (checkpoint.strict_restore; "
                               "without it jtrain falls back to the previous checkpoint)")
        moved = integrity.quarantine(path, "damaged")
        say(f"warning: damaged checkpoint: {problem}; moved to {moved}; "
            + ("falling back to the previous checkpoint" if older
               else "no older checkpoint is left"))

    # -- start-up -------------------------------------------------------------------------
    def restore_or_init(self, abstract_state, init_fn: Callable[[], Any]) -> Start:
        """The start-up precedence above. `abstract_state`: ShapeDtypeStructs with
        shardings (see `abstract_with_shardings`); `init_fn()` builds a fresh state."""
        try:
            return self._restore_or_init(abstract_state, init_fn)
        except BaseException:
            self._mngr.close()  # the run ends here: leave no orbax threads behind
            raise

    def _restore_or_init(self, abstract_state, init_fn) -> Start:
        start = self.resume_newest(abstract_state)
        if start is not None:
            return start
        if self.init.path:
            state, origin = init_from_lib.init_from(self.init, abstract_state, init_fn)
            return Start(state, None, None, "init_from", self.control, origin)
        return Start(init_fn(), None, None, "fresh", self.control)

    @property
    def newest_step(self) -> int | None:
        """The step `resume_newest` tries first: the newest intact one found at start-up."""
        return self._restore_step

    def resume_newest(self, abstract_state) -> Start | None:
        """The newest intact checkpoint restored (one that orbax cannot read is set aside
        and the one before it tried); None when none is left."""
        while self._restore_step is not None:
            try:
                return self._resume(self._restore_step, abstract_state)
            except _Unreadable as e:  # intact bytes that orbax cannot read
                self._damaged(str(e), os.path.join(self.directory, str(self._restore_step)),
                              self.cfg.strict_restore, older=True)
                self._restore_step = self._select()
                self._mngr.reload()
        return None

    def _resume(self, step: int, abstract_state) -> Start:
        path = os.path.join(self.directory, str(step))
        saved_tree = integrity.read_manifest(path)["tree"]
        problem = integrity.compare_trees(saved_tree, integrity.tree_spec(abstract_state))
        if problem:
            raise RestoreError(f"checkpoint {path} does not fit the model: {problem}")
        faults.fault_point("restore", delay=0.02)
        try:
            out = self._mngr.restore(step, args=ocp.args.Composite(
                state=_state_restore_args(abstract_state),
                data=ocp.args.JsonRestore(), control=ocp.args.JsonRestore()))
        except Exception as e:
            first = first_line(e)[:300]
            raise _Unreadable(f"{path}: does not restore ({type(e).__name__}: {first})") \
                from None
        saved = control_lib.RunControl.from_json(out["control"])
        self._accept_config(saved, path)
        data_state = out["data"]
        if faults.skip_data_restore():
            say("warning: ignoring the saved data position (negative control)")
            data_state = None
        return Start(out["state"], step, data_state, "checkpoint", self.control,
                     f"resumed from step {step}")

    def _accept_config(self, saved: control_lib.RunControl, path: str) -> None:
        """Refuse unallowed config changes; carry the record over into this run."""
        current = self.control

        def data_identity(info):  # what would change the batches (names may vary)
            return {k: info[k] for k in ("fingerprint", "num_examples") if k in info}

        old, _ = config_lib.renamed.apply(saved.config)  # an older release's key names
        changes = changes_lib.config_changes(
            {**old, "data_info": data_identity(saved.data_info)},
            {**current.config, "data_info": data_identity(current.data_info)})
        bad = changes_lib.unallowed_changes(changes, tuple(self.cfg.allow_changes),
                                            current.config)
        if bad:
            what = (f"the config changed since {path} was saved: "
                    f"{changes_lib.describe_changes(changes, bad)}")
            raise RestoreError(  # changed_keys: jtrain.train names its own argument
                f"{what}; to resume anyway, allow them: --config.checkpoint.allow_changes="
                f"{','.join(bad)} (or use a new workdir)", changed_keys=bad, what=what)
        history = list(saved.config_changes)
        if changes:
            say("resuming with config changes: "
                + changes_lib.describe_changes(changes, list(changes)))
            history.append({"step": int(os.path.basename(path)),
                            "changes": {k: list(v) for k, v in changes.items()},
                            "allowed": list(self.cfg.allow_changes)})
        self.control = dataclasses.replace(
            saved, config=current.config, config_sha256=current.config_sha256,
            data_info=current.data_info, versions=current.versions,
            config_changes=history, stopped_by=None)

    # -- saving ---------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Is a periodic save due after `step` (every_steps / every_seconds)?"""
        if self.cfg.every_steps and step % self.cfg.every_steps == 0:
            return True
        if not self.cfg.every_seconds:
            return False
        late = time.monotonic() - self._last_save >= self.cfg.every_seconds
        if jax.process_count() == 1:
            return late
        if step % control_lib.SYNC_EVERY:
            return False
        from jax.experimental import multihost_utils

        return bool(multihost_utils.broadcast_one_to_all(np.int32(late)))

    def enters_top_k(self, step: int, metrics: dict) -> bool:
        """Would an eval of `step` with these metrics be among the `keep_top_k` best
        checkpoints (checkpoint.save_on_best: then the loop saves that step)?"""
        value = metrics.get(self.cfg.monitor)
        if not (self.cfg.keep_top_k and self.cfg.save_on_best) or value is None:
            return False
        registry = {**self.control.metric_registry, str(step): float(value)}
        steps = sorted(set(self._mngr.all_steps()) | {step})
        return step in policy.best_steps(registry, steps, self.cfg.keep_top_k, self.cfg.mode)

    def save(self, step: int, state, data_state: dict, *, evals: list | None = None,
             stopped_by: str | None = None, monitors: dict | None = None,
             skip_ledger: list | None = None) -> bool:
        """Start saving `state` at `step` (False if that step is already saved).
        `evals`: this session's evaluations ({"step": s, "eval/...": v}, in order); the
        ones not recorded yet go into the run-control record and the best-k registry.
        `monitors`, `skip_ledger`: the loop's run-control state at `step`."""
        done = self.control.eval_history[-1]["step"] if self.control.eval_history else -1
        for entry in evals or ():
            if done < entry.get("step", -1) <= step:
                self.control.record_eval(entry["step"], entry, self.cfg.monitor)
        if step in self._mngr.all_steps():
            return False
        self._raise_background_error(lambda: self._mngr.wait_until_finished())
        self.push()
        self.control.stopped_by = stopped_by
        if monitors is not None:
            self.control.monitors = monitors
        if skip_ledger is not None:
            self.control.skip_ledger = list(skip_ledger)
        self._inflight = (step, integrity.tree_spec(state))
        self._raise_background_error(lambda: self._mngr.save(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeSave(state),
            data=ocp.args.JsonSave(data_state),
            control=ocp.args.JsonSave(self.control.to_json())), force=True))
        self._last_save = time.monotonic()
        policy.lower_writer_priority(self.writer_nice)
        faults.fault_point("save", delay=0.02)
        if not self.cfg.async_save:
            self.wait()
        return True

    def _seal(self) -> None:
        """orbax's post-finalization callback (background thread, process 0): all files
        are written, the directory is not yet renamed into place: add the manifest."""
        policy.lower_writer_priority(self.writer_nice, threading.get_native_id())
        step, spec = self._inflight
        tmp = glob.glob(os.path.join(glob.escape(self.directory),
                                     f"{step}{integrity.TMP_MARK}*"))
        if len(tmp) != 1:
            raise CheckpointError(f"cannot find the temporary directory of step {step}")
        faults.tear(step, tmp[0])  # debug.faults torn_ckpt: a crash mid-write
        integrity.write_manifest(tmp[0], step, spec)
        if self.mirror is not None:  # uploaded, then committed: visible only when whole
            self.mirror.commit_step(step, tmp[0])

    def push(self) -> None:
        """A workdir on an object store: the run's changed files uploaded and the steps
        the keep policy dropped deleted there (between saves: no upload in flight)."""
        if self.mirror is not None:
            self.mirror.push()

    def _raise_background_error(self, fn):
        try:
            return fn()
        except Exception as e:
            step = self._inflight[0] if self._inflight else "?"
            first = first_line(e)[:300]
            where = (f"{self.mirror.uri}/checkpoints" if self.mirror is not None
                     else self.directory)
            what = f"saving checkpoint step {step} in {where}"  # disk full: named
            raise CheckpointError(f"{what} failed: {type(e).__name__}: {first}", what=what) \
                from e

    def wait(self) -> None:
        """Block until the last save is finished (every pool thread it started reniced);
        raise CheckpointError if it failed."""
        self._raise_background_error(self._mngr.wait_until_finished)
        policy.lower_writer_priority(self.writer_nice)

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def restore_state(self, step: int, abstract_state):
        """The train state saved at `step`, checksums verified (a loss-spike rollback);
        the run's record and data position are left as they are."""
        self.wait()
        path = os.path.join(self.directory, str(step))
        problem = integrity.check_step(path, step)
        if problem:
            raise CheckpointError(f"cannot roll back to {path}: {problem}")
        out = self._mngr.restore(step, args=ocp.args.Composite(
            state=_state_restore_args(abstract_state)))
        return out["state"]

    def all_steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def close(self) -> None:
        try:
            self.wait()
            self.push()
        finally:
            try:
                self._mngr.close()
            except Exception:  # the error that matters was raised by wait()
                pass


class CheckpointReader:
    """Read-only access to a run's checkpoints (`jtrain.evaluate`, tools): moves and
    deletes nothing, so it is safe while another process trains in the same workdir.
    `path`: a workdir or its checkpoints/ directory.

    Examples:
        ```python
        from jtrain.checkpoint import CheckpointReader

        reader = CheckpointReader("runs/a")
        print(reader.all_steps())                        # [100, 200]
        state, data_state, control = reader.restore(200, b.state_abstract)
        reader.close()
        ```
    """

    def __init__(self, path: str):
        path = os.path.abspath(path)
        sub = os.path.join(path, "checkpoints")
        self.directory = sub if os.path.isdir(sub) else path

    def all_steps(self) -> list[int]:
        """Steps of finished saves (a manifest is present; checked fully on restore)."""
        steps, _, _ = integrity.scan(self.directory)
        return [s for s in steps if os.path.isfile(
            os.path.join(self.directory, str(s), integrity.MANIFEST))]

    def restore(self, step: int, abstract_state):
        """(state, data_state, run-control dict) at `step`; RestoreError if the step is
        damaged or does not fit `abstract_state` (ShapeDtypeStructs with shardings)."""
        path = os.path.join(self.directory, str(step))
        problem = integrity.check_step(path, step)
        if problem:
            raise RestoreError(f"damaged checkpoint: {problem}")
        saved_tree = integrity.read_manifest(path)["tree"]
        problem = integrity.compare_trees(saved_tree, integrity.tree_spec(abstract_state))
        if problem:
            raise RestoreError(f"checkpoint {path} does not fit the model: {problem}")
        with ocp.Checkpointer(_item_handlers()["state"]) as ck:
            state = ck.restore(os.path.join(path, "state"), args=_state_restore_args(
                abstract_state))
        items = []
        for name in ("data", "control"):
            items.append(runfiles.read_object(os.path.join(path, name, "metadata"),
                                              error=RestoreError))
        return state, items[0], items[1]

    def close(self) -> None:
        pass


def _item_handlers() -> dict:
    # Uncompressed: zstd bought ~8 % on float arrays and cost ~4 s per save and ~7 s per
    # restore of 1.2 GB on 2 CPU cores (orbax's default for StandardSave compresses).
    return {"state": ocp.PyTreeCheckpointHandler(use_compression=False),
            "data": ocp.JsonCheckpointHandler(), "control": ocp.JsonCheckpointHandler()}


def _state_restore_args(abstract_state):
    """Restore into `abstract_state`'s shapes, dtypes and shardings (dtypes and shapes
    were checked against the manifest first: orbax would cast silently)."""
    return ocp.args.PyTreeRestore(
        item=abstract_state,
        restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state))


def abstract_with_shardings(abstract_tree, shardings):
    """ShapeDtypeStructs carrying the target shardings: what orbax restores into.

    Examples:
        ```python
        target = abstract_with_shardings(b.state_abstract, b.state_shardings)
        # target's leaves: jax.ShapeDtypeStruct(shape, dtype, sharding=...)
        ```
    """
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract_tree, shardings)
