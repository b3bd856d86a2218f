"""tensorboardX's event-file modules without torch: its package `__init__` imports torch
(1.5-2.5 s here) for `SummaryWriter`, and jtrain's TensorBoard writer (observe.writers)
needs only the event file writer, the protos and `summary`."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types


def import_without_torch() -> None:
    """Let the event-file modules of tensorboardX import without its package
    `__init__`, which imports torch (1.5-2.5 s here) for `SummaryWriter`; an event file
    needs no torch. The package stands in sys.modules with its submodules reachable; the
    first access to anything else (`tensorboardX.SummaryWriter`, from the user's code)
    runs the real `__init__` into it, so nothing changes for them."""
    if "tensorboardX" in sys.modules:
        return
    spec = importlib.util.find_spec("tensorboardX")
    if spec is None or spec.origin is None or not spec.submodule_search_locations:
        return  # not installed: the import below names it
    pkg = types.ModuleType("tensorboardX")
    pkg.__path__, pkg.__spec__, pkg.__file__ = list(spec.submodule_search_locations), \
        spec, spec.origin
    pkg.__package__ = "tensorboardX"

    def lazy(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if importlib.util.find_spec(f"tensorboardX.{name}") is not None:
            return importlib.import_module(f"tensorboardX.{name}")
        del pkg.__getattr__
        with open(spec.origin) as f:
            exec(compile(f.read(), spec.origin, "exec"), pkg.__dict__)  # noqa: S102
        return getattr(pkg, name)

    pkg.__getattr__ = lazy
    sys.modules["tensorboardX"] = pkg


class _Boto3OnUse:
    """Stands for boto3 in tensorboardX's record writer until an s3:// event file uses
    it: the writer imports boto3 at import time when it is installed (0.3-0.7 s here),
    for an S3 backend jtrain never asks of it (event files go to a local path)."""

    def __getattr__(self, name: str):
        return getattr(importlib.import_module("boto3"), name)


def import_record_writer() -> None:
    """tensorboardX's record writer imported without importing boto3; its S3 backend
    works as before for anyone who uses it (boto3 is imported then)."""
    if "tensorboardX.record_writer" in sys.modules or "boto3" in sys.modules:
        return
    sys.modules["boto3"] = None  # type: ignore[assignment]  # `import boto3` -> ImportError
    try:
        rw = importlib.import_module("tensorboardX.record_writer")
    finally:
        del sys.modules["boto3"]
    if importlib.util.find_spec("boto3") is not None:
        rw.boto3, rw.S3_ENABLED = _Boto3OnUse(), True
