"""A thin layer over orbax's CheckpointManager. Reads `config.checkpoint`.

One checkpoint = one step directory with three items:
  state  the TrainState (params, optimizer state, step, rng, loss scale, skip counter)
  data   the data iterator position (JSON)
  meta   run bookkeeping (JSON): config hash, data fingerprint, versions
Saves are asynchronous: `save` returns once the arrays are copied off the device; the
write finishes in the background and is awaited by the next save or by `close`.
"""

from __future__ import annotations

import logging
import os

import jax
import orbax.checkpoint as ocp

log = logging.getLogger("jtrain")


class Checkpointer:
    def __init__(self, directory: str, ckpt_cfg):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=ckpt_cfg.max_to_keep,
            enable_async_checkpointing=ckpt_cfg.async_save,
            cleanup_tmp_directories=True,
            create=True,
        )
        self._mngr = ocp.CheckpointManager(self.directory, options=options,
                                           item_names=("state", "data", "meta"))

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def save(self, step: int, state, data_state: dict, meta: dict, *, force: bool = False) -> bool:
        return self._mngr.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state),
            meta=ocp.args.JsonSave(meta)), force=force)

    def restore(self, step: int, abstract_state):
        """(state, data_state, meta) at `step`, restored into `abstract_state`'s
        shapes, dtypes and shardings (a tree of jax.ShapeDtypeStruct with shardings)."""
        out = self._mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=ocp.args.JsonRestore(),
            meta=ocp.args.JsonRestore()))
        return out["state"], out["data"], out["meta"]

    def restore_latest(self, abstract_state):
        """The newest checkpoint that restores, or None. A checkpoint that fails to
        restore (e.g. killed mid-write) is reported in one line and the previous one
        is tried."""
        for step in reversed(self.all_steps()):
            try:
                return (step,) + self.restore(step, abstract_state)
            except (FileNotFoundError, ValueError, OSError) as e:
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                log.warning("checkpoint %s/%d does not restore (%s); trying an older one",
                            self.directory, step, first[:200])
        return None

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()


def abstract_with_shardings(abstract_tree, shardings):
    """ShapeDtypeStructs carrying the target shardings: what orbax restores into."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract_tree, shardings)
