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

Importing the package has no side effects and imports nothing heavy: each name below is
loaded from its module on first use (`import jtrain` does not import JAX). Process
set-up of the command-line entry points is `jtrain.boot`.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "Build": "jtrain.engine.assemble", "build": "jtrain.engine.assemble",
    "TrainResult": "jtrain.engine.run", "train": "jtrain.engine.run",
    "ConfigError": "jtrain.errors", "DataError": "jtrain.errors",
    "ModelFns": "jtrain.models.adapters", "to_model_fns": "jtrain.models.adapters",
    "defaults": "jtrain.config", "resolve": "jtrain.config",
    "batch_sharding": "jtrain.mesh", "host_to_device": "jtrain.mesh",
    "make_mesh": "jtrain.mesh",
    "make_model": "jtrain.models",
    "make_optimizer": "jtrain.optim",
    "make_policy": "jtrain.precision",
    "TrainState": "jtrain.state", "init_state": "jtrain.state",
    "make_abstract_state": "jtrain.state", "state_sha256": "jtrain.state",
    "make_eval_step": "jtrain.step", "make_train_step": "jtrain.step",
    "Sample": "jtrain.engine.sample", "sample": "jtrain.engine.sample",
}

__all__ = sorted(_EXPORTS)

def __getattr__(name: str):
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'jtrain' has no attribute {name!r}")
    import time

    t0 = time.perf_counter()
    value = getattr(importlib.import_module(module_name), name)
    from jtrain.observe import startup  # its "imports" phase, for library use

    startup.mark("imports", time.perf_counter() - t0)
    globals()[name] = value  # the next lookup does not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
