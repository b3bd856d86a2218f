"""Checkpoints: everything that writes or reads a run's saved state.

    manager     Checkpointer (orbax async save, restore-or-init, refusals, retention) and
                the read-only CheckpointReader
    integrity   our manifest under orbax: per-file size + CRC-32, tree spec, quarantine
    policy      which checkpoints are kept; priority of background writes
    tiers       the fast local tier beside the persistent one (checkpoint.local_dir):
                which tier saves a step, which one a restart restores, lost_local
    init_from   `init.path`: a new run from an export, another run, or
                Hugging Face weights (hf:DIR)
    export      parameters as safetensors (`python -m jtrain.export`)
    tensorfile  the safetensors format: written, and read with every field checked
    hf          the built-in transformer's tensors in Hugging Face's layout and back;
                `init.path=hf:DIR` reading, config checks, `init.map`
    hf_export   `export --format=hf`: a directory transformers loads (needs the hf extra)
    store       a run directory on object storage (s3://, gs://, through fsspec): the
                staging copy, steps committed by a marker after their upload

Public names: Checkpointer, CheckpointReader, Start, abstract_with_shardings, and the
errors RestoreError, CheckpointError (from jtrain.errors). The engine opens a run's
checkpoints with `open_checkpoints` (a `Checkpointer`, or `Tiers` with a local tier).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from jtrain.errors import CheckpointError, RestoreError

if TYPE_CHECKING:
    from jtrain.checkpoint.manager import (Checkpointer, CheckpointReader, Start,
                                           abstract_with_shardings)
    from jtrain.checkpoint.tiers import Tiers, open_checkpoints  # noqa: F401 - the engine's

# Each name is loaded from its module on first use: a command that only reads a path
# (`jtrain.checkpoint.store.is_remote`) or fails on a bad flag does not import orbax,
# JAX and Flax through this package.
_EXPORTS = {"Checkpointer": "manager", "CheckpointReader": "manager", "Start": "manager",
            "abstract_with_shardings": "manager", "Tiers": "tiers",
            "open_checkpoints": "tiers"}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:  # a submodule not imported yet (`checkpoint.manager`), or nothing
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # the next lookup does not come here
    return value


__all__ = ["CheckpointError", "CheckpointReader", "Checkpointer", "RestoreError", "Start",
           "abstract_with_shardings"]
