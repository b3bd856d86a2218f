"""Every private API of JAX, flax, qwix, grain, optuna and torch that jtrain uses, one
named function each (no other module names a `_src` module or a private attribute of
theirs; tests/test_internals.py has a canary for each). Each says what it reaches for,
why no public API does it, and what happens the day it moves: a fallback that changes
no result, or `jtrain: dependency error: <library> <version>: <what> moved; ...`
(errors.DependencyError), never an error that blames the config or data. A patch of a
library lasts one run (`compile_cache_patches`). Imports only jtrain.errors."""

from __future__ import annotations

import contextlib
import functools
import logging
import types

from jtrain.errors import DependencyError


def moved(dist: str, what: str, cannot: str) -> DependencyError:
    """The one line for a private `what` of the installed `dist` that is gone or changed;
    `cannot`: what does not work without it."""
    import importlib.metadata as md

    try:
        version = md.version(dist)
    except md.PackageNotFoundError:
        version = "(version unknown)"
    return DependencyError(f"{dist} {version}", f"{what} moved; {cannot}; install the "
                                                "version jtrain pins (constraints.txt)")


def backends_started() -> bool:
    """Whether XLA's backends started (XLA_FLAGS set later are not read):
    `jax._src.xla_bridge.backends_are_initialized`; every public way starts them."""
    try:
        from jax._src import xla_bridge

        started = xla_bridge.backends_are_initialized
    except (ImportError, AttributeError):
        raise moved("jax", "jax._src.xla_bridge.backends_are_initialized",
                    "whether XLA started before its flags were set cannot be told") from None
    return bool(started())


def _global_state():
    try:
        from jax._src import distributed

        return distributed.global_state
    except (ImportError, AttributeError):
        raise moved("jax", "jax._src.distributed.global_state", "processes cannot reach "
                    "the coordination service's key-value store (preflight, heartbeat)"
                    ) from None


def distributed_client():
    """The coordination-service client of `jax.distributed.initialize` (its key-value
    store carries preflight reports and heartbeats), None in one process:
    `jax._src.distributed.global_state.client`, which JAX does not expose."""
    import jax

    if not jax.distributed.is_initialized():
        return None
    client = getattr(_global_state(), "client", None)
    if client is None or not hasattr(client, "blocking_key_value_get"):
        raise moved("jax", "jax._src.distributed.global_state.client",
                    "processes cannot reach the coordination service's key-value store")
    return client


def coordinator_address() -> str:
    """The coordinator address JAX used (perhaps from its cluster detection):
    `global_state.coordinator_address`. Moved: "" (preflight's loopback check skipped)."""
    try:
        return str(_global_state().coordinator_address or "")
    except (DependencyError, AttributeError):
        return ""


def cluster_detector():
    """`detect(timeout_s) -> (coordinator, num_processes, process_id)` (None: not found)
    from JAX's cluster detection (SLURM, Cloud TPU): `jax._src.clusters.ClusterEnv`; the
    public `jax.distributed.initialize()` detects and starts at once, and jtrain's roll
    call comes between the two."""
    try:
        from jax._src import clusters

        detect = clusters.ClusterEnv.auto_detect_unset_distributed_params
    except (ImportError, AttributeError):
        raise moved("jax", "jax._src.clusters.ClusterEnv.auto_detect_unset_distributed_params",
                    "--distributed=auto cannot detect the cluster; pass "
                    "--coordinator_address, --num_processes and --process_id") from None
    return lambda timeout_s: tuple(detect(None, None, None, None, None, int(timeout_s))[:3])


def lowering_logger() -> logging.Logger:
    """The logger `jax._src.interpreters.pxla`, whose DEBUG "Compiling <fn> with global
    shapes ..." names a compile's arguments (JAX's monitoring events carry no shapes).
    Moved: no record arrives, a recompile's shapes read "?"."""
    return logging.getLogger("jax._src.interpreters.pxla")


def load_compiled_on(compiled, device):
    """`compiled` (for one device) loaded onto `device`, serialized and deserialized with
    that device's assignment (invariant.py: every device runs the same machine code):
    `serialize_executable._JaxPjrtUnpickler`, `xla_client.DeviceList`; the public
    `deserialize_and_load` keeps the original device. Moved: an exception; the caller
    compiles on `device`."""
    import io

    import jax
    import numpy as np
    from jax._src.lib import xla_client
    from jax.experimental import serialize_executable as se
    from jax.extend.backend import get_compile_options

    class Unpickler(se._JaxPjrtUnpickler):
        def persistent_load(self, pid):
            if pid[0] == "device":
                return device
            if pid[0] == "exec":
                options = get_compile_options(1, 1, device_assignment=np.array([[device.id]]),
                                              backend=self.backend)
                return self.backend.deserialize_executable(
                    pid[1], xla_client.DeviceList((device,)), options)
            return super().persistent_load(pid)

    blob, in_tree, out_tree = se.serialize(compiled)
    unloaded, args_info, no_kwargs = Unpickler(io.BytesIO(blob), device.client,
                                               [device]).load()
    return jax.stages.Compiled(unloaded.load(), [], in_tree.unflatten(args_info), out_tree,
                               no_kwargs=no_kwargs)


@contextlib.contextmanager
def compile_cache_patches():
    """For the `with` block (a run), JAX's persistent-cache writer and eviction replaced,
    put back on leaving; yields the names of the patches put in (none when a run inside
    a run finds them in place). JAX has no option for either:

    `write_from_every_process` (`compiler._cache_write`): on XLA:CPU each process's key
    is its own (it hashes its devices' topology), yet JAX writes from process 0 only, so
    the others compiled every program at every start; here each writes its own entries.
    `list_once_per_process` (`lru_cache.LRUCache._evict_if_needed`): JAX lists the
    directory and reads every access time at each write (0.35 CPU s with 6,400
    entries); here a process lists it at its first write and when its own writes since
    would pass the limit. Moved or another signature: JAX's own stays (same results)."""
    undo = [u for u in (_patch_cache_write(), _patch_eviction()) if u is not None]
    try:
        yield tuple(name for name, _ in undo)
    finally:
        for _, restore in reversed(undo):
            restore()


def _signature(fn) -> list[str] | None:
    import inspect

    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def _patch_cache_write():
    try:
        import jax
        from jax._src import compilation_cache as jcc
        from jax._src import compiler, distributed
    except ImportError:
        return None
    write = getattr(compiler, "_cache_write", None)
    if write is None or getattr(write, "_jtrain_patch", False) or _signature(write) != [
            "cache_key", "compile_time_secs", "module_name", "backend", "executable",
            "host_callbacks"] or not hasattr(jcc, "put_executable_and_time"):
        return None

    def every_process(cache_key, compile_time_secs, module_name, backend, executable,
                      host_callbacks):
        if (distributed.global_state.process_id == 0 or host_callbacks
                or getattr(backend, "platform", None) != "cpu"
                or compile_time_secs < jax.config.jax_persistent_cache_min_compile_time_secs):
            return write(cache_key, compile_time_secs, module_name, backend, executable,
                         host_callbacks)
        try:
            jcc.put_executable_and_time(cache_key, module_name, executable, backend,
                                        int(compile_time_secs))
        except Exception as e:  # noqa: BLE001 - a cache entry not written costs a compile
            logging.warning("jtrain: compile cache: entry %s not written (%s: %s)",
                            module_name, type(e).__name__, e)

    every_process._jtrain_patch = True  # type: ignore[attr-defined]
    compiler._cache_write = every_process
    return "write_from_every_process", lambda: setattr(compiler, "_cache_write", write)


def _patch_eviction():
    try:
        from jax._src import lru_cache
    except ImportError:
        return None
    cls = getattr(lru_cache, "LRUCache", None)
    evict = getattr(cls, "_evict_if_needed", None)
    suffixes = (getattr(lru_cache, "_CACHE_SUFFIX", None),
                getattr(lru_cache, "_ATIME_SUFFIX", None))
    if evict is None or getattr(evict, "_jtrain_patch", False) or None in suffixes or \
            _signature(evict) != ["self", "additional_size"]:
        return None

    def evict_if_needed(self, *, additional_size: int = 0) -> None:
        if not self.eviction_enabled:
            return
        known = getattr(self, "_jtrain_size", None)
        if known is None or known + additional_size > self.max_size:
            known = evict_least_recent(self.path, self.max_size - additional_size,
                                       *suffixes)
        self._jtrain_size = known + additional_size

    evict_if_needed._jtrain_patch = True  # type: ignore[attr-defined]
    cls._evict_if_needed = evict_if_needed
    return "list_once_per_process", lambda: setattr(cls, "_evict_if_needed", evict)


def evict_least_recent(path, target_size: int, cache_suffix: str, atime_suffix: str) -> int:
    """Deletes the least recently read entries of the cache directory `path` until their
    sizes sum to at most `target_size`; returns the sum left. An entry deleted meanwhile,
    or without its access time (being written), is skipped or counts as the oldest."""
    import heapq

    entries, size = [], 0
    for cache_file in path.glob(f"*{cache_suffix}"):
        key = cache_file.name[:-len(cache_suffix)]
        try:
            st = cache_file.stat()
            length = st.st_size if hasattr(st, "st_size") else st.length
        except OSError:
            continue
        try:
            atime = int.from_bytes((path / f"{key}{atime_suffix}").read_bytes(), "little")
        except OSError:
            atime = 0
        size += length
        heapq.heappush(entries, (atime, key, length))
    while size > target_size and entries:
        _, key, length = heapq.heappop(entries)
        for name in (key + cache_suffix, key + atime_suffix):
            try:
                (path / name).unlink()
            except OSError:
                pass
        size -= length
    return size


def trace_primal(x):
    """A value under jax.grad (`JVPTracer.primal`) as the jit trace holds it."""
    import jax

    while isinstance(x, jax.core.Tracer) and not hasattr(x, "parent") \
            and hasattr(x, "primal"):
        x = x.primal
    return x


def trace_producer(x):
    """(primitive name, input tracers) of the operation that made `x` in a jit trace, or
    None (an input, a constant): `DynamicJaxprTracer.parent` (a jaxpr exists only after
    the trace; LoRA finds a matmul's weight while tracing). See `check_trace_walk`."""
    eqn = getattr(x, "parent", None)
    if eqn is None:
        return None
    return eqn.primitive.name, list(eqn.in_tracers)


@functools.cache
def check_trace_walk() -> None:
    """Raises DependencyError unless the trace walk reaches a value's input, under jit
    and jax.grad (else LoRA would adapt nothing and blame finetune.lora.targets)."""
    import jax
    import jax.numpy as jnp

    found = []

    def f(x):
        y = jnp.sin(x * 2.0)
        made = trace_producer(trace_primal(y))
        inner = made and len(made[1]) == 1 and trace_producer(made[1][0])
        found.append(bool(made and made[0] == "sin" and inner and
                          any(t is trace_primal(x) for t in inner[1])))
        return y

    try:
        jax.make_jaxpr(f)(1.0)
        jax.make_jaxpr(jax.grad(f))(1.0)
    except Exception:  # noqa: BLE001 - any failure of the walk: it moved
        found.append(False)
    if not found or not all(found):
        raise moved("jax", "DynamicJaxprTracer.parent (jax._src.interpreters.partial_eval)",
                    "LoRA cannot tell which weight a matmul reads")


def matmul_paths() -> tuple[str, ...]:
    """The paths of jnp.matmul that qwix intercepts: `jax.numpy.matmul` and the one `x @ w`
    calls (`jax._src.numpy.tensor_contractions.matmul`, found through `__wrapped__`)."""
    import jax.numpy as jnp

    inner = getattr(jnp.matmul, "__wrapped__", None)
    module = getattr(inner, "__module__", None)
    if module is None or module == "jax.numpy":
        raise moved("jax", "jax.numpy.matmul.__wrapped__", "LoRA cannot intercept `x @ w`")
    return "jax.numpy.matmul", f"{module}.{inner.__name__}"


@functools.cache
def qwix_lora() -> types.SimpleNamespace:
    """qwix's LoRA helpers that models/lora.py builds its matmul paths from (qwix exports
    only its providers): adapter shapes, parameters and delta (`providers.lora._*`), the
    einsum parser, the current module (`utils.flax_util`). ImportError without qwix."""
    import qwix

    try:
        from qwix._src.core import einsum_info
        from qwix._src.providers import lora as qlora, ptq
        from qwix._src.utils import flax_util

        parts = types.SimpleNamespace(
            parse_einsum=einsum_info.EinsumInfo.parse,
            layer_shapes=qlora._create_lora_layer_shapes,
            params=qlora._get_or_create_lora_params,
            delta=qlora._compute_lora_delta,
            einsum_shapes=qlora._parse_einsum_str_for_lora,
            with_aux=ptq.WithAux,
            module=flax_util.get_current_module,
            module_path=flax_util.get_current_module_path,
            find_param=flax_util.find_param,
            unbox=flax_util.unbox)
        qwix.LoraProvider._get_current_rule_and_op_id  # noqa: B018 - present, or moved
    except (ImportError, AttributeError) as e:
        raise moved("qwix", f"qwix._src: {getattr(e, 'name', None) or e}",
                    "LoRA (finetune.lora.rank > 0) cannot run") from None
    return parts


def qwix_rule(provider, op: str):
    """The rule matched for the current module and op (checked by `qwix_lora`)."""
    return provider._get_current_rule_and_op_id(op, only_rule=True)[0]


def qwix_rank(provider) -> int:
    """The rank of the provider's first rule (`Provider._rules`)."""
    rules = getattr(provider, "_rules", None)
    if not rules:
        raise moved("qwix", "qwix.LoraProvider._rules", "LoRA cannot adapt an einsum")
    return rules[0].rank


def grain_loader_shard(loader) -> tuple[int, int]:
    """(shard_index, shard_count) a grain DataLoader reads: `DataLoader._shard_options`
    (no getter). Moved: DependencyError, never a data error."""
    opts = getattr(loader, "_shard_options", None)
    try:
        return int(opts.shard_index), int(opts.shard_count)
    except (AttributeError, TypeError):
        raise moved("grain", "grain.DataLoader._shard_options", "which shard a grain "
                    "DataLoader reads cannot be checked") from None


def grain_loader_epochs(loader):
    """A grain DataLoader's `_sampler._num_epochs` (None: forever; no getter). Moved, or
    another sampler: "unknown" (said in messages; an eval loader is read to its end)."""
    return getattr(getattr(loader, "_sampler", None), "_num_epochs", "unknown")


def optuna_storage(study):
    """A Study's storage (tune/: trials failed atomically, heartbeats, a trial read by
    number): `Study._storage`, which optuna keeps private."""
    storage = getattr(study, "_storage", None)
    if storage is None:
        raise moved("optuna", "optuna.Study._storage", "jtrain tune cannot update trials")
    return storage


def optuna_study_id(study) -> int:
    """`Study._study_id`, else (moved) asked of the storage by the study's name."""
    sid = getattr(study, "_study_id", None)
    return sid if sid is not None else optuna_storage(study).get_study_id_from_name(
        study.study_name)


def optuna_trial_id(study, trial) -> int:
    """A (Frozen)Trial's `_trial_id`, else (moved) asked of the storage by number."""
    tid = getattr(trial, "_trial_id", None)
    return tid if tid is not None else optuna_storage(
        study).get_trial_id_from_study_id_trial_number(optuna_study_id(study), trial.number)


def _torch_worker():
    try:
        from torch.utils.data._utils import worker

        worker.WorkerInfo, worker._worker_info  # noqa: B018 - present, or moved
    except (ImportError, AttributeError):
        raise moved("torch", "torch.utils.data._utils.worker._worker_info", "a torch "
                    "IterableDataset cannot be split by process") from None
    return worker


def torch_worker_info_class() -> type:
    """torch's WorkerInfo (what `get_worker_info()` returns; not exported)."""
    return _torch_worker().WorkerInfo


def torch_with_worker_info(info, fn):
    """fn() with `get_worker_info()` returning `info` (a torch IterableDataset splits
    itself by it): the global `_utils.worker._worker_info`, set by torch's workers only."""
    worker = _torch_worker()
    previous = worker._worker_info
    worker._worker_info = info
    try:
        return fn()
    finally:
        worker._worker_info = previous
