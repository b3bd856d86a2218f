"""XLA compiles: the persistent compilation cache (`compile.*`) and a record of every
compile of the run — how many, how long, persistent-cache hits and misses, and any
compile after the first step with its cause (the function and its argument shapes).

The cache: `compile.cache_dir` ("auto" = `$XDG_CACHE_HOME/jtrain/xla`, else
`~/.cache/jtrain/xla`; "" = off). The folder is the user's own (`own_folder`): created
0700; one owned by another user or writable by group or others is refused in one line
(the default one has its mode narrowed instead), since JAX runs whatever entry it finds
under a key. JAX decides once per process, at its first compile,
whether the cache is used, and by default skips compiles under 1 s and small entries:
`configure_cache` sets the directory, caches every compile (thresholds 0) and resets
JAX's decision, so it works even after arrays exist. Several runs and processes may
share the directory. With the size limit `compile.cache_max_gb` JAX takes a file lock
around every read and write and evicts the least-recently used entries past it. For
the length of a run (engine/run.py), `internals.compile_cache_patches` lets every
process of an XLA:CPU run write its own entries and lists the directory once per
process instead of at every write.

`Recorder` listens to JAX's monitoring events (one backend compile each, a cache hit or
miss each) and to the "Compiling <fn> with global shapes ..." record of JAX's lowering
logger, which names the function and its argument shapes; DEBUG records it captures
are dropped there, so nothing new is printed.
"""

from __future__ import annotations

import logging
import os
import stat
import threading

import jax
from jax import monitoring

from jtrain import internals
from jtrain.errors import ConfigError

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_MISS_EVENT = "/jax/compilation_cache/cache_misses"
_CONFIGURED: tuple | None = None  # (directory, max_gb) of configure_cache's last call


def cache_path(cache_dir: str) -> str | None:
    """The directory `compile.cache_dir` names; None when it is off ("")."""
    if not cache_dir:
        return None
    if cache_dir == "auto":
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                                 ".cache")
        return os.path.join(base, "jtrain", "xla")
    return os.path.abspath(os.path.expanduser(cache_dir))


def configure_cache(cache_dir: str, max_gb: float = 0.0) -> str | None:
    """Turn JAX's persistent compilation cache on at `cache_path(cache_dir)` with every
    compile cached (or off for ""); returns the directory or None. A directory that
    cannot be created turns the cache off (the run does not depend on it) and says so."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    global _CONFIGURED
    path = cache_path(cache_dir)
    if path is not None:
        try:
            own_folder(path, fix=cache_dir == "auto")
        except ConfigError:
            # Refused before any entry is read: JAX is left with no cache rather than
            # an earlier configuration's (the caller may catch the error and go on).
            _CONFIGURED = None
            jax.config.update("jax_compilation_cache_dir", None)
            cc.reset_cache()
            raise
        except OSError as e:
            logging.warning("jtrain: compile cache off: cannot create %s (%s)", path,
                            e.strerror or e)
            path = None
    if _CONFIGURED == (path, max_gb) and jax.config.jax_compilation_cache_dir == path:
        return path  # this process set it up already (and JAX may have started it)
    _CONFIGURED = (path, max_gb)
    jax.config.update("jax_compilation_cache_dir", path)
    if path is not None:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: all
        # A size limit makes JAX lock the directory (filelock) around every read and
        # write: what lets several runs and processes share it safely.
        jax.config.update("jax_compilation_cache_max_size",
                          int(max_gb * 2**30) if max_gb > 0 else -1)
    cc.reset_cache()  # JAX checks "is the cache used" once, at the first compile
    return path


def own_folder(path: str, fix: bool) -> None:
    """The cache folder must be the user's own: JAX loads an entry by its key, which is
    no signature, so whoever can write there picks the code a step runs. Created 0700;
    owned by another user, or writable by group or others, it is one ConfigError (as ssh
    refuses a key file), except that `fix` (the default folder, jtrain's to manage) has
    its mode narrowed to 0700."""
    if not os.path.isdir(path):
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.chmod(path, 0o700)  # makedirs' mode is narrowed by the umask, never widened
    st = os.stat(path)
    if st.st_uid != os.getuid():
        raise ConfigError("compile.cache_dir", f"{path} is owned by uid {st.st_uid}, not "
                          f"by you (uid {os.getuid()}): a compiled step loaded from it "
                          "runs as yours; use a folder of your own")
    if fix and st.st_mode & 0o077:  # the default folder: 0700, as it was created
        os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)
    elif st.st_mode & 0o022:
        who = " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002))
                           if st.st_mode & bit)
        raise ConfigError("compile.cache_dir", f"{path} is writable by {who} (mode "
                          f"{stat.S_IMODE(st.st_mode):o}): whoever writes there picks "
                          f"the code your steps run; chmod 700 {path}, or use a folder "
                          "of your own")


def configure_cache_for_reader(cache_dir: str) -> str | None:
    """The cache for a command that opens a run (`jtrain evaluate`, `jtrain replay`): on
    in this machine's default place with the default size limit (the schema's defaults
    of compile.cache_dir and compile.cache_max_gb), or off when
    the run had it off (`cache_dir` is the run's `compile.cache_dir`). The run's own
    directory and limit are not followed: a run directory is data, and opening it writes
    nothing outside it and evicts nothing."""
    from jtrain.config.schema import SCHEMA

    compile_cfg = SCHEMA["compile"]
    return configure_cache(compile_cfg["cache_dir"].default if cache_dir else "",
                           compile_cfg["cache_max_gb"].default)


class Recorder:
    """Counts the compiles of this process while active; after `first_step_done()`
    every compile is a recompile, recorded with its cause."""

    _active: "Recorder | None" = None
    _installed = False
    _lock = threading.Lock()

    def __init__(self):
        self.compiles = 0
        self.compile_sec = 0.0
        self.hits = 0
        self.misses = 0
        self.after_first_step: list[dict] = []  # {"function", "shapes", "sec"}
        self._first_step_done = False
        self._reported = 0
        self._seen: dict[str, str] = {}  # function -> the shapes it was compiled for
        self._lowering: list[tuple[str, str]] = []  # (function, shapes), newest last

    def __enter__(self) -> "Recorder":
        _install()
        Recorder._active = self
        self._logger = internals.lowering_logger()
        self._old_level = self._logger.level
        # Its "Compiling ..." record is DEBUG unless jax_log_compiles: enable DEBUG on
        # that logger and drop its DEBUG records after reading them, unless the user had
        # DEBUG on there already.
        quiet = not self._logger.isEnabledFor(logging.DEBUG)
        self._filter = _LoweringFilter(self, drop_debug=quiet)
        self._logger.addFilter(self._filter)
        if quiet:
            self._logger.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc) -> None:
        if Recorder._active is self:
            Recorder._active = None
        self._logger.removeFilter(self._filter)
        self._logger.setLevel(self._old_level)

    def first_step_done(self) -> None:
        self._first_step_done = True

    def unreported(self) -> list[dict]:
        """The compiles after the first step not returned by an earlier call."""
        new = self.after_first_step[self._reported:]
        self._reported = len(self.after_first_step)
        return new

    def snapshot(self) -> tuple[int, int, int, float]:
        """(compiles, hits, misses, seconds) so far: phases subtract two of them."""
        return self.compiles, self.hits, self.misses, self.compile_sec

    def _on_compile(self, fun_name: str, seconds: float) -> None:
        self.compiles += 1
        self.compile_sec += seconds
        shapes = next((s for f, s in reversed(self._lowering) if f == fun_name), "?")
        # "again": a function compiled before (new shapes, shardings or a new jit of it);
        # "first": its first compile (e.g. the eval step at the first eval).
        again = fun_name in self._seen and not _anonymous_or_eager(fun_name)
        if self._first_step_done:
            self.after_first_step.append({"function": fun_name, "shapes": shapes,
                                          "sec": round(seconds, 4),
                                          "kind": "again" if again else "first",
                                          "before": self._seen.get(fun_name, "")})
        self._seen[fun_name] = shapes

    @property
    def recompiles(self) -> list[dict]:
        """Compiles after the first step of functions compiled before."""
        return [c for c in self.after_first_step if c["kind"] == "again"]

    def summary(self) -> dict:
        """The compile figures of summary.json."""
        return {"compile/count": self.compiles, "compile/sec": round(self.compile_sec, 3),
                "compile/cache_hits": self.hits, "compile/cache_misses": self.misses,
                "compile/after_first_step": len(self.after_first_step),
                "compile/recompiles": len(self.recompiles),
                "compile/after_first_step_causes": [
                    {k: v for k, v in c.items() if k != "before"}
                    for c in self.after_first_step[:20]]}


def _anonymous_or_eager(fun_name: str) -> bool:
    """A lambda, a private helper (JAX's `_psum`, `_identity_fn` of process_allgather)
    or one primitive run outside jit (`jit(slice)`: orbax slicing a replicated array per
    device at a save): compiled per device and shape by design, not a step compiled
    again."""
    name = fun_name[4:-1] if fun_name.startswith("jit(") else fun_name
    return "<lambda>" in name or name.startswith("_") or hasattr(jax.lax, name)


class _LoweringFilter(logging.Filter):
    """Keeps the function name and shapes of each lowering; drops DEBUG records that
    only this recorder asked for."""

    def __init__(self, recorder: Recorder, drop_debug: bool):
        super().__init__()
        self._recorder = recorder
        self._drop_debug = drop_debug

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg.startswith("Compiling ") and record.args:
            name, avals = record.args[0], record.args[1]
            shapes = ", ".join(str(a) for a in avals)
            self._recorder._lowering = self._recorder._lowering[-15:] + [
                (str(name), shapes[:500])]
        return record.levelno > logging.DEBUG or not self._drop_debug


def _install() -> None:
    """Registers the monitoring listeners once per process (they cannot be removed);
    they forward to the active Recorder, if any."""
    with Recorder._lock:
        if Recorder._installed:
            return
        Recorder._installed = True

    def on_duration(event: str, duration: float, **kwargs) -> None:
        rec = Recorder._active
        if rec is not None and event == _COMPILE_EVENT:
            rec._on_compile(str(kwargs.get("fun_name", "?")), duration)

    def on_event(event: str, **kwargs) -> None:
        rec = Recorder._active
        if rec is None:
            return
        if event == _HIT_EVENT:
            rec.hits += 1
        elif event == _MISS_EVENT:
            rec.misses += 1

    monitoring.register_event_duration_secs_listener(on_duration)
    monitoring.register_event_listener(on_event)


def abstract_batch(example: dict, global_batch: int, sharding):
    """ShapeDtypeStructs of the global batch `example` comes in (host_to_device's
    arrays: numpy dtypes canonicalised as device_put does)."""
    import numpy as np

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        (global_batch,) + np.shape(x), jax.dtypes.canonicalize_dtype(np.asarray(x).dtype),
        sharding=sharding), example)


def precompile(step_fn, abstract_state, batch, *, mesh, rules=None) -> threading.Thread:
    """Lower and compile `step_fn` for (abstract_state, batch) in a daemon thread, under
    the mesh and logical-axis rules the loop traces it with. The executable goes into
    the persistent cache, where the step's first call finds it; a failure here is left
    to that call to report."""
    from flax import linen as nn

    from jtrain import mesh as mesh_lib

    def work():
        try:
            with jax.set_mesh(mesh), nn.logical_axis_rules(rules or mesh_lib.LOGICAL_RULES):
                step_fn.lower(abstract_state, batch).compile()
        except Exception:  # noqa: BLE001 - the real first call raises it properly
            pass

    thread = threading.Thread(target=work, name="jtrain-precompile", daemon=True)
    thread.start()
    return thread
