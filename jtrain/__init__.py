"""jtrain: a JAX/Flax training framework with a PyTorch-compatible data layer.

The engine is `train(config, workdir, model=..., train_data=...)`; the CLI
(`python -m jtrain.main`) is a thin shell over it. `build(config, sample=..., ...)` is
its whole set-up (model, mesh, optimizer, abstract state, shardings, jitted steps), and
its pieces are public so research code can assemble them one by one:

    mesh = jtrain.make_mesh(cfg.mesh)
    tx, schedule = jtrain.make_optimizer(cfg.optim, cfg.total_steps)
    abstract, shardings = jtrain.make_abstract_state(model_fns, tx, policy, inputs, mesh, seed)
    state = jtrain.init_state(model_fns, tx, policy, inputs, mesh, seed, shardings)
    step = jax.jit(jtrain.make_train_step(model_fns.apply, loss_fn, tx, schedule), ...)
"""

import sys as _sys
import time as _time

_IMPORT_T0 = _time.perf_counter()  # observe.startup: the "imports" phase

# `python -m jtrain.main`, `jtrain train` and `python -m jtrain.tune`: SIGTERM / SIGINT
# during the imports and start-up (before train() installs control.Stopper) are recorded
# here instead of killing the process with status 143; the Stopper takes them over:
# nothing new to save, exit 0. Only for the CLI: importing jtrain from a user's script
# changes no signal handling.
_EARLY_SIGNALS: list[str] = []
# jtrain's own entry points start again once with huge-page malloc (jtrain.hostmem: the
# XLA:CPU step's scratch buffer is mapped fresh each step); before any heavy import.
_ENTRY_POINT = _sys.argv[:1] == ["-m"] and any(a in ("jtrain.main", "jtrain.bench")
                                                for a in getattr(_sys, "orig_argv", ()))
if _ENTRY_POINT:
    from jtrain import hostmem as _hostmem

    _hostmem.maybe_reexec()
if (_sys.argv[:1] == ["-m"] and {"jtrain.main", "jtrain.tune"} & set(
        getattr(_sys, "orig_argv", ()))) or (
        _sys.argv[0].endswith("jtrain") and _sys.argv[1:2] in (["train"], ["tune"])):
    import signal as _signal

    def _early(signum, frame):
        if not _EARLY_SIGNALS:
            _EARLY_SIGNALS.append(_signal.Signals(signum).name)

    for _sig in (_signal.SIGTERM, _signal.SIGINT):
        _signal.signal(_sig, _early)
if _ENTRY_POINT:  # signals held across the re-exec reach the handlers above now
    _hostmem.release_signals()

from jtrain.models.adapters import ModelFns, to_model_fns  # noqa: E402
from jtrain.config import defaults, resolve
from jtrain.errors import ConfigError, DataError
from jtrain.mesh import batch_sharding, host_to_device, make_mesh
from jtrain.models import make_model
from jtrain.optim import make_optimizer
from jtrain.precision import make_policy
from jtrain.state import TrainState, init_state, make_abstract_state, state_sha256
from jtrain.step import make_eval_step, make_train_step
from jtrain.train import Build, TrainResult, build, train

__version__ = "0.1.0"

from jtrain.observe import startup as _startup  # noqa: E402

_startup.mark("imports", _time.perf_counter() - _IMPORT_T0)

__all__ = [
    "Build", "ConfigError", "DataError", "ModelFns", "TrainResult", "TrainState",
    "batch_sharding", "build",
    "defaults", "host_to_device", "init_state", "make_abstract_state", "make_eval_step",
    "make_mesh", "make_model", "make_optimizer", "make_policy", "make_train_step", "resolve",
    "state_sha256", "to_model_fns", "train",
]
