"""`python -m jtrain.main --config=... --workdir=... --dry_run [--dry_run_devices=64]`.

Checks a configuration for a topology without training: on `--dry_run_devices` fake CPU
devices (set by jtrain.main before JAX starts its backend; 0 = the devices there are)
it builds the mesh, the abstract state and its shardings, lowers and compiles the train
and eval steps for their real shapes without creating a parameter or running a step,
and prints

  - per-device memory of each compiled step (XLA's memory analysis: arguments, outputs,
    temporaries, aliased = donated),
  - every parameter group's sharding (PartitionSpec and per-device shape, Adam moments
    alike), and
  - any dimension the model asked to shard that the mesh cannot (not divisible, two
    dimensions on one mesh axis, a logical axis without a rule), by parameter path.

Exit 0 when it is sound; a bad configuration (the mesh, the batch, a conflict above) is
one line and exit 2, like any config error. Nothing is written to the workdir.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from jtrain import config as config_lib
from jtrain import data as data_lib
from jtrain import mesh as mesh_lib
from jtrain import state as state_lib
from jtrain.engine.assemble import build, model_sample
from jtrain.errors import ConfigError
from jtrain.observe import compiles as compiles_lib


def run(config, *, say=print) -> dict:
    """The dry run of `config` on the devices JAX has; returns the report as a dict
    (printed through `say`). Raises ConfigError for a configuration that cannot run."""
    t0 = time.perf_counter()
    user_data = data_lib.UserData()  # a DataLoader's settings: in the one resolution
    cfg = config_lib.resolve(config, data_settings=user_data.settings)
    compiles_lib.configure_cache(cfg.compile.cache_dir, cfg.compile.cache_max_gb)
    config_lib.validate(cfg, num_devices=jax.device_count())
    train_src, eval_src, _ = data_lib.make_sources(cfg.data, user_data.train, user_data.eval)
    example = (eval_src if eval_src is not None else train_src)[0]
    sample = model_sample(cfg, train_src[0])
    b = build(cfg, sample=sample, eval_example=example, train_example=train_src[0])
    mesh = b.mesh
    say(f"jtrain: dry run on {jax.device_count()} {jax.devices()[0].platform} devices, "
        f"mesh {' x '.join(f'{k}={v}' for k, v in mesh.shape.items())}, "
        f"model {b.model_name}, global batch {cfg.data.batch_size}")

    rng = jax.random.key(cfg.seed)
    inputs = jax.tree.map(lambda s: jax.ShapeDtypeStruct((1,) + s.shape[1:], s.dtype),
                          b.sample_inputs)
    with jax.set_mesh(mesh):
        conflicts = mesh_lib.sharding_conflicts(b.model_fns.annotated(rng, inputs), mesh)
    groups = _param_groups(b.abstract.params, b.shardings.params)
    say("jtrain: parameter sharding (path: shape, spec -> per-device shape):")
    for line in groups:
        say("  " + line)
    if conflicts:
        for _, why in conflicts:
            say(f"  conflict: {why}")
        more = f" (+{len(conflicts) - 1} more above)" if len(conflicts) > 1 else ""
        key, why = conflicts[0]
        raise ConfigError(key, f"{why}; that parameter would be replicated instead{more}")

    batch_sharding = mesh_lib.batch_sharding(mesh)
    train_batch = compiles_lib.abstract_batch(train_src[0], cfg.data.batch_size,
                                              batch_sharding)
    memory = {}
    from flax import linen as nn

    with jax.set_mesh(mesh), nn.logical_axis_rules(mesh_lib.LOGICAL_RULES):
        compiled = b.train_step.lower(b.abstract_with_shardings(), train_batch).compile()
        memory["train_step"] = _memory(compiled)
        if eval_src is not None:
            eval_batch = _abstract_eval_batch(cfg, eval_src, batch_sharding)
            params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                                    sharding=s),
                                  state_lib.eval_part(b.abstract),
                                  state_lib.eval_part(b.shardings))
            memory["eval_step"] = _memory(b.eval_step.lower(params, eval_batch).compile())
    for name, m in memory.items():
        say(f"jtrain: {name} per device: " + ", ".join(
            f"{k} {_mib(v)}" for k, v in m.items()))
    state_bytes = _per_device_bytes(b.abstract, b.shardings)
    say(f"jtrain: state per device {_mib(state_bytes)} (params + optimizer state); "
        f"checked in {time.perf_counter() - t0:.1f} s; nothing was initialised or run")
    return {"devices": jax.device_count(), "mesh": dict(mesh.shape), "memory": memory,
            "state_bytes_per_device": state_bytes, "params": groups}


def _abstract_eval_batch(cfg, eval_src, sharding):
    """The eval step's batch as the eval loop builds it (padded, with its mask)."""
    local = cfg.eval.batch_size or cfg.data.batch_size
    first = next(iter(data_lib.eval_batches(eval_src, local_batch=local, process_index=0,
                                            process_count=1, max_batches=1)))
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        np.shape(x), jax.dtypes.canonicalize_dtype(np.asarray(x).dtype), sharding=sharding),
        first)


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    if m is None:
        return {}
    out = {k: int(getattr(m, f"{k}_size_in_bytes", 0)) for k in
           ("argument", "output", "temp", "alias", "generated_code")}
    out["peak estimate"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    return out


def _per_device_bytes(abstract, shardings) -> int:
    total = 0
    for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings), strict=True):
        total += int(np.prod(s.shard_shape(a.shape))) * np.dtype(a.dtype).itemsize
    return total


def _param_groups(params, shardings) -> list[str]:
    """One line per parameter; layers that repeat with the same shape and sharding
    are one line ('layers_0..3/...')."""
    import re

    rows: dict[tuple, list[int]] = {}
    for (path, a), s in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                            jax.tree.leaves(shardings), strict=True):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        m = re.search(r"(\d+)", name)
        key = (re.sub(r"\d+", "#", name, count=1) if m else name, tuple(a.shape),
               str(s.spec), tuple(s.shard_shape(a.shape)))
        rows.setdefault(key, []).append(int(m.group(1)) if m else -1)
    lines = []
    for (name, shape, spec, shard), idx in rows.items():
        if "#" in name:
            name = name.replace("#", f"{min(idx)}..{max(idx)}" if len(idx) > 1 else str(idx[0]))
        lines.append(f"{name}: {list(shape)}, {spec} -> {list(shard)}")
    return lines


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
