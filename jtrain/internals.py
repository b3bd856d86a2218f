"""Every private API of a library that jtrain reaches for, in one place: JAX, flax, qwix,
grain, optuna, torch. No other module of jtrain names a private module (`_src`) or a
private attribute of these libraries; tests/test_internals.py holds a canary for each
function here (on the pinned versions the private thing exists and behaves as assumed)
and checks what happens when it is gone.

Each function says what it reaches for, why no public API does it, and what happens the
day the library moves it: a fallback that changes no result (a check skipped, a
slower path), or one line, `jtrain: dependency error: <library> <version>: <what> moved;
<what cannot work>` (errors.DependencyError, exit 1) — never an error that blames the
user's config or data. A patch of a library is installed for a run and undone at its end
(`compile_cache_patches`).

Ground floor: imports only third-party packages and jtrain.errors.
"""

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


# -- JAX: the backend, the coordination service, cluster detection ------------------------


def backends_started() -> bool:
    """Whether XLA's backends have started (XLA_FLAGS set later are not read).
    Reaches for `jax._src.xla_bridge.backends_are_initialized`: no public API answers
    without starting them (`jax.devices()` does). Moved: DependencyError (deterministic=true
    cannot tell whether its XLA flags apply)."""
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
    """The coordination-service client `jax.distributed.initialize` made (its key-value
    store carries the preflight reports and heartbeats), or None in a run of one
    process. Reaches for `jax._src.distributed.global_state.client`: JAX exposes no
    client. Moved: DependencyError, in multi-process runs only."""
    import jax

    if not jax.distributed.is_initialized():
        return None
    client = getattr(_global_state(), "client", None)
    if client is None or not hasattr(client, "blocking_key_value_get"):
        raise moved("jax", "jax._src.distributed.global_state.client",
                    "processes cannot reach the coordination service's key-value store")
    return client


def coordinator_address() -> str:
    """The coordinator address `jax.distributed.initialize` used ("" if unknown).
    Reaches for `jax._src.distributed.global_state.coordinator_address` (it may come from
    JAX's cluster detection, which jtrain does not see). Moved: "" (preflight's check of a
    loopback address across hosts is skipped)."""
    try:
        return str(_global_state().coordinator_address or "")
    except (DependencyError, AttributeError):
        return ""


def cluster_detector():
    """`detect(init_timeout_s) -> (coordinator, num_processes, process_id)` (None where
    nothing was found) from JAX's cluster detection (SLURM, Cloud TPU, ...), without
    starting the runtime. Reaches for `jax._src.clusters.ClusterEnv`: the public
    `jax.distributed.initialize()` detects and starts at once, and jtrain's roll call
    must come between the two. Moved: DependencyError (--distributed=auto cannot work;
    pass --coordinator_address, --num_processes and --process_id)."""
    try:
        from jax._src import clusters

        detect = clusters.ClusterEnv.auto_detect_unset_distributed_params
    except (ImportError, AttributeError):
        raise moved("jax", "jax._src.clusters.ClusterEnv.auto_detect_unset_distributed_params",
                    "--distributed=auto cannot detect the cluster; pass "
                    "--coordinator_address, --num_processes and --process_id") from None
    return lambda timeout_s: tuple(detect(None, None, None, None, None, int(timeout_s))[:3])


# -- JAX: compiles -----------------------------------------------------------------------


def lowering_logger() -> logging.Logger:
    """The logger of JAX's lowering, whose DEBUG record "Compiling <fn> with global shapes
    ..." names each compiled function and its argument shapes (observe.compiles).
    `jax._src.interpreters.pxla` by name: the monitoring events carry no shapes. Moved:
    no record arrives and a recompile's shapes read "?"."""
    return logging.getLogger("jax._src.interpreters.pxla")


def load_compiled_on(compiled, device):
    """`compiled` (a jax.stages.Compiled for one device) loaded onto `device`: its
    executable serialized and deserialized with that device's assignment, as JAX's
    persistent cache does for an entry compiled on another device (invariant.py: every
    device runs the same machine code). Reaches for
    `jax.experimental.serialize_executable._JaxPjrtUnpickler` and
    `jax._src.lib.xla_client.DeviceList`: the public `deserialize_and_load` keeps the
    device it was compiled for. Moved: any exception; the caller compiles the program
    on `device` instead."""
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
    """For the `with` block (a run), JAX's persistent-cache writer and its size-limit
    eviction replaced by jtrain's, put back on leaving; yields the names of those in
    place. A patch already in place (a run inside a run) is left to its owner.

    `write_from_every_process`: on XLA:CPU each process's cache key is its own (it hashes
    the topology of the process's devices), yet JAX writes entries from process 0 only,
    so the other processes compiled every program at every start; here they write their
    own entries (different keys: different files). Other platforms keep JAX's rule.
    `list_once_per_process`: JAX lists the cache directory, stats every entry and reads
    its access time at every write (0.35 CPU s a compile with 6,400 entries); here a
    process lists it at its first write and again only when its own writes since would
    pass the limit.

    Reaches for `jax._src.compiler._cache_write`, `jax._src.compilation_cache.
    put_executable_and_time`, `jax._src.lru_cache.LRUCache._evict_if_needed` and its
    file suffixes: JAX has no option for either. Moved or changed signature: JAX's own
    writer or eviction stays (slower starts, same results)."""
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
    """("write_from_every_process", undo) or None (not patched here)."""
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
    """("list_once_per_process", undo) or None (not patched here)."""
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
    """Deletes the entries of the cache directory `path` (a pathlib / epath Path) with the
    oldest access times until their sizes sum to at most `target_size`; returns the sum
    left. An entry another process deleted meanwhile, or without its access time (being
    written), is skipped or counts as the oldest."""
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


# -- JAX: the trace (LoRA finds the weight a matmul reads) --------------------------------


def trace_primal(x):
    """A value under jax.grad (a JVPTracer) as the jit trace holds it, where the
    operation that made it can be looked up; anything else as it is. Reaches for
    `JVPTracer.primal` (jax._src.interpreters.ad)."""
    import jax

    while isinstance(x, jax.core.Tracer) and not hasattr(x, "parent") \
            and hasattr(x, "primal"):
        x = x.primal
    return x


def trace_producer(x):
    """(primitive name, input tracers) of the operation that made the traced value `x`
    in a jit trace, or None (an input of the trace, a constant, a concrete array).
    Reaches for `DynamicJaxprTracer.parent` and `TracingEqn.in_tracers / .primitive`
    (jax._src.interpreters.partial_eval): a jaxpr is only built after the trace, and
    LoRA must find a matmul's weight while tracing. `check_trace_walk` says whether this
    works with the installed JAX."""
    eqn = getattr(x, "parent", None)
    if eqn is None:
        return None
    return eqn.primitive.name, list(eqn.in_tracers)


@functools.cache
def check_trace_walk() -> None:
    """Raises DependencyError unless `trace_producer` / `trace_primal` follow a traced
    value back to its input, under jit and under jax.grad (LoRA would otherwise adapt no
    weight and blame finetune.lora.targets)."""
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
    """The dotted paths of jnp.matmul that qwix intercepts: `jax.numpy.matmul` and the
    module attribute `x @ w` calls (`jax._src.numpy.tensor_contractions.matmul`), derived
    from the jitted function's wrapped one. Moved (no `__wrapped__`): DependencyError
    (LoRA would miss every `x @ w`)."""
    import jax.numpy as jnp

    inner = getattr(jnp.matmul, "__wrapped__", None)
    module = getattr(inner, "__module__", None)
    if module is None or module == "jax.numpy":
        raise moved("jax", "jax.numpy.matmul.__wrapped__", "LoRA cannot intercept `x @ w`")
    return "jax.numpy.matmul", f"{module}.{inner.__name__}"


# -- qwix: LoRA's helpers ------------------------------------------------------------------


@functools.cache
def qwix_lora() -> types.SimpleNamespace:
    """qwix's own LoRA helpers, which models/lora.py redoes its two matmul paths from:
    the adapter shapes, parameters and delta (`qwix._src.providers.lora._*`), the einsum
    parser, the current module and its path, qwix's parameter search and unboxing
    (`qwix._src.utils.flax_util`). qwix exports only the providers. Raises ImportError
    without qwix (an optional dependency); moved: DependencyError (LoRA cannot run)."""
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
    """The rule qwix's provider matched for the current module and op
    (`Provider._get_current_rule_and_op_id`, checked by `qwix_lora`)."""
    return provider._get_current_rule_and_op_id(op, only_rule=True)[0]


def qwix_rank(provider) -> int:
    """The rank of the provider's first rule (`Provider._rules`). Moved: DependencyError."""
    rules = getattr(provider, "_rules", None)
    if not rules:
        raise moved("qwix", "qwix.LoraProvider._rules", "LoRA cannot adapt an einsum")
    return rules[0].rank


# -- grain ---------------------------------------------------------------------------------


def grain_loader_shard(loader) -> tuple[int, int]:
    """(shard_index, shard_count) a grain DataLoader reads. Reaches for
    `DataLoader._shard_options`: grain exposes no getter. Moved: DependencyError (a grain
    DataLoader cannot be checked against the run's processes), never a data error."""
    opts = getattr(loader, "_shard_options", None)
    try:
        return int(opts.shard_index), int(opts.shard_count)
    except (AttributeError, TypeError):
        raise moved("grain", "grain.DataLoader._shard_options", "which shard a grain "
                    "DataLoader reads cannot be checked") from None


def grain_loader_epochs(loader):
    """The `num_epochs` of a grain DataLoader's IndexSampler (None: forever), or
    "unknown". Reaches for `DataLoader._sampler._num_epochs`: neither has a getter.
    Moved, or another sampler: "unknown" (said in messages; a finite eval loader is
    read to its end)."""
    return getattr(getattr(loader, "_sampler", None), "_num_epochs", "unknown")


# -- optuna --------------------------------------------------------------------------------


def optuna_storage(study):
    """The storage of an optuna Study (tune/: a running trial failed atomically, its
    heartbeat, an earlier trial read by number). Reaches for `Study._storage`: optuna
    keeps the storage it wraps (a cache over an RDB) private. Moved: DependencyError."""
    storage = getattr(study, "_storage", None)
    if storage is None:
        raise moved("optuna", "optuna.Study._storage", "jtrain tune cannot update trials")
    return storage


def optuna_study_id(study) -> int:
    """The study's id in its storage: `Study._study_id`, else (moved) asked of the
    storage by the study's name."""
    sid = getattr(study, "_study_id", None)
    return sid if sid is not None else optuna_storage(study).get_study_id_from_name(
        study.study_name)


def optuna_trial_id(study, trial) -> int:
    """A trial's id in its storage: `Trial._trial_id` / `FrozenTrial._trial_id`, else
    (moved) asked of the storage by the trial's number."""
    tid = getattr(trial, "_trial_id", None)
    return tid if tid is not None else optuna_storage(
        study).get_trial_id_from_study_id_trial_number(optuna_study_id(study), trial.number)


# -- torch ---------------------------------------------------------------------------------


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
    """fn() with `torch.utils.data.get_worker_info()` returning `info`: what a torch
    IterableDataset reads to split itself, here by jtrain's stream shards. Reaches for
    the module global `torch.utils.data._utils.worker._worker_info`: torch sets it only in
    its own worker processes. Moved: DependencyError."""
    worker = _torch_worker()
    previous = worker._worker_info
    worker._worker_info = info
    try:
        return fn()
    finally:
        worker._worker_info = previous
