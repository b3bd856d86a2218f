"""Two-tier checkpoints: a fast local tier beside the persistent one. Reads
`checkpoint.local_dir` and `checkpoint.local_every_steps` (docs/guide/checkpoints.md).

The local tier is LOCAL_DIR/<id>/<step>/ on the machine's own disk, in the persistent
tier's format, keeping its newest step only. `<id>` is a random name stored in
WORKDIR/local_tier.json at the first start (read back as data: 16 hex digits, a folder
inside LOCAL_DIR and not a link), and LOCAL_DIR/<id>/tier_owner.json names the workdir
that owns it: a new or copied workdir never reads another run's local checkpoints.

A step goes to the persistent tier when a persistent save is due (or a stop, a best
eval, the end), else to the local tier when `local_every_steps` divides it; never to
both. So (checked by `lag`) the local tier is ahead by less than one persistent
interval, and losing it loses at most what a run without it loses. Restore scans each
tier as `Checkpointer` does and restores the newer of their newest intact steps
(`newer_tier`; a tie goes to the persistent tier; an unreadable local one falls back).
One process only: a multi-process run with `checkpoint.local_dir` is a config error.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from typing import Any

import jax

from jtrain import paths
from jtrain.checkpoint.manager import Checkpointer, CheckpointReader, Start
from jtrain.control import faults
from jtrain.errors import ConfigError, WorkdirError
from jtrain.observe import layout
from jtrain.observe.console import say

ID_FILE = "local_tier.json"  # in the workdir: {"id": the local tier's subfolder}
OWNER_FILE = "tier_owner.json"  # in that subfolder: {"identity": [dev, ino], "workdir"}


def open_checkpoints(workdir: str, config, data_info: dict | None = None, *, mirror=None):
    """The run's checkpointer: a `Checkpointer`, or `Tiers` with checkpoint.local_dir
    (`mirror`: a workdir on an object store, for the persistent tier)."""
    if not config.checkpoint.local_dir:
        return Checkpointer(workdir, config, data_info, mirror=mirror)
    return Tiers(workdir, config, data_info, mirror=mirror)


def local_folder(workdir: str, local_dir: str) -> str:
    """LOCAL_DIR/<id>, the id read from (or first written to) WORKDIR/local_tier.json.

    The id is the workdir's data: a plain token (`_ID`) or one ConfigError; the folder
    is never a link. The folder belongs to one workdir, the one whose identity (device
    and inode) LOCAL_DIR/<id>/tier_owner.json records: a copy of the workdir (cp -r)
    finds another owner there and starts a fresh tier of its own, with one warning
    line, rather than share (and prune) the original's steps."""
    if "://" in local_dir:
        raise ConfigError("checkpoint.local_dir", f"{local_dir!r} is not a local path: the "
                          "local tier is a folder on this machine's disk")
    workdir = os.path.abspath(workdir)
    base = os.path.abspath(os.path.expanduser(local_dir))
    path = os.path.join(workdir, ID_FILE)
    os.makedirs(workdir, exist_ok=True)
    me = _identity(workdir)
    run_id = _read_id(path)
    if run_id is not None:
        owner = _read_owner(base, run_id)
        if owner is not None and owner.get("identity") != me:
            say(f"warning: checkpoint.local_dir: {os.path.join(base, run_id)} belongs to "
                f"the workdir {owner.get('workdir')!s} (this one is a copy of it): this "
                "copy starts a fresh local tier")
            run_id = None
    if run_id is None:
        run_id = uuid.uuid4().hex[:16]
        layout.write_file(path, json.dumps({"id": run_id}))  # never through a link
    folder = _folder(base, run_id)
    os.makedirs(folder, exist_ok=True)
    layout.write_file(_owner_file(base, run_id),
                      json.dumps({"identity": me, "workdir": workdir}))
    return folder


_ID = re.compile(r"[0-9a-f]{16}")


def _read_id(path: str) -> str | None:
    """The id in local_tier.json; None when there is none; else one ConfigError."""
    try:
        with open(path, encoding="utf-8") as f:
            run_id = json.load(f)["id"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError("checkpoint.local_dir", f"cannot read {path}: {e}; delete it to "
                          "start the local tier afresh") from None
    if not isinstance(run_id, str) or not _ID.fullmatch(run_id):
        raise ConfigError("checkpoint.local_dir", f"{path}: id {run_id!r} is not an id "
                          "jtrain writes (16 hex digits); delete the file to start the "
                          "local tier afresh")
    return run_id


def _folder(base: str, run_id: str) -> str:
    folder = os.path.join(base, run_id)
    if os.path.islink(folder):
        raise ConfigError("checkpoint.local_dir", f"{folder} is a symbolic link: the local "
                          "tier writes and deletes only in a folder of its own; remove "
                          "the link")
    return paths.confined(base, run_id, f"checkpoint.local_dir: {run_id}")


def _identity(workdir: str) -> list[int]:
    st = os.stat(workdir)
    return [st.st_dev, st.st_ino]


def _owner_file(base: str, run_id: str) -> str:
    return os.path.join(base, run_id, OWNER_FILE)


def _read_owner(base: str, run_id: str) -> dict | None:
    """The owner LOCAL_DIR/<id>/tier_owner.json records; None when none is recorded (a
    tier made before owners were recorded is adopted)."""
    try:
        with open(_owner_file(base, run_id), encoding="utf-8") as f:
            owner = json.load(f)
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def local_steps(workdir: str, local_dir: str) -> list[int]:
    """The finished steps (a manifest present) of the run's local tier, read only: what
    --verify_resume expects a restart to resume from, with `newer_tier`."""
    base = os.path.abspath(os.path.expanduser(local_dir))
    try:
        folder = _folder(base, _read_id(os.path.join(workdir, ID_FILE)) or "")
    except (ConfigError, WorkdirError):
        return []
    return CheckpointReader(folder).all_steps() if os.path.isdir(folder) else []


def newer_tier(local: int | None, persistent: int | None) -> str | None:
    """Which tier holds the newest intact step: "local", "persistent" or None (neither
    holds one); a tie goes to the persistent tier."""
    if local is not None and (persistent is None or local > persistent):
        return "local"
    return None if persistent is None else "persistent"


def save_tier(step: int, every_steps: int, local_every_steps: int,
              persistent_due: bool) -> str | None:
    """Which tier saves after `step`: "persistent" when its save is due, else "local"
    every `local_every_steps`, else None."""
    if persistent_due:
        return "persistent"
    if local_every_steps and step % local_every_steps == 0:
        return "local"
    return None


def lag(total_steps: int, every_steps: int, local_every_steps: int) -> int:
    """The most steps the local tier is ever ahead of the persistent tier over a run
    of `total_steps` saved by `save_tier` (the invariant: below `every_steps`)."""
    persistent = local = worst = 0
    for step in range(1, total_steps + 1):
        due = bool(every_steps and step % every_steps == 0) or step == total_steps
        tier = save_tier(step, every_steps, local_every_steps, due)
        if tier == "persistent":
            persistent = step
        elif tier == "local":
            local = step
        worst = max(worst, local - persistent)
    return worst


class _NewestOnly:
    """orbax's preservation-policy protocol: the local tier keeps its newest step."""

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        return [i == len(checkpoints) - 1 for i in range(len(checkpoints))]


class Tiers:
    """The persistent `Checkpointer` and the local one, behind the interface the loop
    uses (`due`, `save`, `wait`, `restore_or_init`, ...). Everything but the save of a
    local step, the restore of the newest step and closing is the persistent tier's."""

    def __init__(self, workdir: str, config, data_info: dict | None = None, *, mirror=None):
        if jax.process_count() > 1:
            raise ConfigError("checkpoint.local_dir", "the local tier is implemented for "
                              "one process only; unset it for a multi-process run")
        self.local_every_steps = int(config.checkpoint.local_every_steps)
        folder = local_folder(workdir, config.checkpoint.local_dir)
        self.persistent = Checkpointer(workdir, config, data_info, mirror=mirror)
        try:
            self.local = Checkpointer(workdir, config, data_info, directory=folder,
                                      keep=_NewestOnly())
        except BaseException:
            self.persistent.close()
            raise
        self._due: tuple[int, str] | None = None  # (step, tier) of the last `due`
        faults.on_lost_local(self.lose_local)

    @property
    def control(self):
        return self.persistent.control

    @control.setter
    def control(self, value) -> None:
        self.persistent.control = value

    def __getattr__(self, name: str) -> Any:  # latest_step, all_steps, restore_state, ...
        if name in ("persistent", "local"):  # not set yet: __init__ failed
            raise AttributeError(name)
        return getattr(self.persistent, name)

    # -- start-up -------------------------------------------------------------------------
    def restore_or_init(self, abstract_state, init_fn) -> Start:
        try:
            persistent = self.persistent.newest_step
            if newer_tier(self.local.newest_step, persistent) == "local":
                start = self.local.resume_newest(abstract_state)
                if start is not None and newer_tier(start.step, persistent) == "local":
                    self.persistent.control = self.local.control
                    start.origin += " (local tier)"
                    return start
            return self.persistent.restore_or_init(abstract_state, init_fn)
        except BaseException:
            self.local.close()
            raise

    # -- saving ---------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        tier = save_tier(step, self.persistent.cfg.every_steps, self.local_every_steps,
                         self.persistent.due(step))
        self._due = None if tier is None else (step, tier)
        return tier is not None

    def save(self, step: int, state, data_state: dict, **record) -> bool:
        """The local tier saves `step` when `due(step)` chose it; every other save
        (a stop, a best eval, the end, a persistent interval) is persistent."""
        due, self._due = self._due, None
        if due != (step, "local"):
            return self.persistent.save(step, state, data_state, **record)
        self.local.control = self.persistent.control  # one record, both tiers
        return self.local.save(step, state, data_state, **record)

    def wait(self) -> None:
        self.local.wait()
        self.persistent.wait()

    def lose_local(self) -> None:
        """debug.faults lost_local: the local tier's checkpoints deleted, as a replaced
        machine has none (its write in flight finished first)."""
        self.local.wait()
        shutil.rmtree(self.local.directory, ignore_errors=True)
        say(f"fault: deleted the local checkpoint tier {self.local.directory}")

    def close(self) -> None:
        faults.on_lost_local(None)
        try:
            self.local.close()
        finally:
            self.persistent.close()
