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
