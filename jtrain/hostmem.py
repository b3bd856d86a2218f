"""Host memory behind XLA:CPU's per-step scratch buffer: huge pages for glibc's mmaps.

What was measured (the base LM step, `configs/base.py`, on a 2-core CPU; strace and
getrusage): XLA:CPU allocates the step's whole scratch space (its buffer assignment's
temp allocation, 344 MB for the base LM) with malloc at each run and frees it at the end.
glibc serves anything above its mmap threshold (at most 32 MiB) with a fresh `mmap` and
gives it back with `munmap`, so every step touches 344 MB of new pages: 84 k minor page
faults and ~150 ms of kernel time per step. No malloc setting keeps it: the threshold
cannot go above 32 MiB, and with mmap disabled (`M_MMAP_MAX=0`) the request still comes
from a non-main arena, whose heaps top out at 64 MiB and fall back to mmap (one arena:
faults 84 k -> 31 k but peak RSS 0.86 -> 2.1 GB from heap fragmentation).

glibc >= 2.35 has the tunable `glibc.malloc.hugetlb=1`: malloc then asks for transparent
huge pages (`madvise(MADV_HUGEPAGE)`) on what it maps, and the same 344 MB arrive in
2 MiB pages: 630 faults per step instead of 84 k, ~8 % less CPU time per step, the same
peak RSS. Tunables are read once when the process starts, so jtrain's own entry points
(`python -m jtrain.main|evaluate|export|tune|bench`, the `jtrain` command) re-execute
themselves once with it added to `GLIBC_TUNABLES` before anything heavy is imported
(`maybe_reexec`, called by `jtrain.boot.start`). A script that calls `jtrain.train()`
can get the same by starting Python with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, or by
calling `maybe_reexec()` as its first line. `JTRAIN_HUGETLB=0` turns the re-exec off.

The scratch block itself is smaller with XLA:CPU's plain scheduler: its default
"concurrency-optimized" scheduler orders the step's ops so that independent ones may run
at once, which keeps more buffers alive together (base LM: 328 MB of scratch; with
`--xla_cpu_enable_concurrency_optimized_scheduler=false` 260 MB, the same bits in every
parameter after training). The same entry points add that flag to `XLA_FLAGS` before JAX
starts (`cpu_flags`), unless `XLA_FLAGS` names the flag already (set it to `true` there
to keep XLA's default). It is an XLA:CPU option: other backends ignore it.

Malloc arenas: glibc gives each thread that allocates its own arena (up to 8 per core),
and memory freed in one arena is not reused by another; XLA:CPU's worker threads each
allocate the step's buffers below the mmap threshold, so every arena keeps its own
high-water mark. Capped at 2 arenas (`mallopt(M_ARENA_MAX)`, before any thread starts:
`limit_arenas`, called by `jtrain.boot.start`) the peak RSS of `bench peers` on 2 cores
fell from 819-884 to 722-752 MB (lm_base) and from 415-451 to 390-392 MB (lm_debug), the
same bits in every parameter (docs/benchmarks.md, "Memory and page faults of the base
LM"). `JTRAIN_MALLOC_ARENAS=N` sets another cap, `0` keeps glibc's default; a cap the
user set (`MALLOC_ARENA_MAX`, `glibc.malloc.arena_max` in `GLIBC_TUNABLES`) is kept.
"""

from __future__ import annotations

import os
import signal
import sys

TUNABLE = "glibc.malloc.hugetlb"
OFF_ENV = "JTRAIN_HUGETLB"
DONE_ENV = "JTRAIN_HUGETLB_REEXEC"  # set in the re-executed process: never twice
HELD = (signal.SIGTERM, signal.SIGINT)
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
# XLA:CPU options the entry points set unless XLA_FLAGS names them (see the module doc).
CPU_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",)
ARENAS_ENV = "JTRAIN_MALLOC_ARENAS"
DEFAULT_ARENAS = 2
M_ARENA_MAX = -8  # glibc's mallopt parameter number


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the C library when it is glibc, else None (musl, macOS, ...)."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, OSError, ValueError):
        return None


def thp_usable() -> bool:
    """Whether the kernel gives huge pages to regions that ask (mode always or madvise)."""
    try:
        with open(THP_MODE_FILE) as f:
            mode = f.read()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def tunables_with_hugetlb(environ) -> str | None:
    """The GLIBC_TUNABLES value to re-exec with, or None when nothing should change."""
    if environ.get(OFF_ENV, "1") == "0" or environ.get(DONE_ENV):
        return None
    current = environ.get("GLIBC_TUNABLES", "")
    if TUNABLE + "=" in current:  # set already (by us, or the user chose a value)
        return None
    if not sys.platform.startswith("linux") or (glibc_version() or (0, 0)) < (2, 35):
        return None
    if not thp_usable():
        return None
    return f"{current}:{TUNABLE}=1" if current else f"{TUNABLE}=1"


def maybe_reexec() -> None:
    """Re-execute this process (same pid, same argv) with huge-page malloc, at most once.

    Returns only when nothing needs changing (already set, not glibc >= 2.35, THP off,
    `JTRAIN_HUGETLB=0`, or the interpreter's argv is unknown)."""
    value = tunables_with_hugetlb(os.environ)
    argv = getattr(sys, "orig_argv", None)
    if value is None or not argv or not sys.executable:
        return
    env = dict(os.environ, GLIBC_TUNABLES=value, **{DONE_ENV: "1"})
    sys.stdout.flush()
    sys.stderr.flush()
    # exec resets handlers but keeps the signal mask and pending signals: a SIGTERM /
    # SIGINT that comes while the new image starts waits until `release_signals()`,
    # after jtrain.boot has installed its start-up handlers.
    old = signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
    try:
        os.execve(sys.executable, [sys.executable] + list(argv[1:]), env)
    except OSError:  # cannot exec (a sandbox, a deleted interpreter): run as we are
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def release_signals() -> None:
    """In the re-executed process: deliver the signals held across the exec."""
    if os.environ.get(DONE_ENV):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD)


def cpu_flags(environ) -> str | None:
    """XLA_FLAGS with CPU_FLAGS added (each unless already named there), or None when
    nothing changes."""
    current = environ.get("XLA_FLAGS", "")
    named = {f.split("=")[0].lstrip("-") for f in current.split()}
    extra = [f for f in CPU_FLAGS if f.split("=")[0].lstrip("-") not in named]
    if not extra:
        return None
    return " ".join([current, *extra]) if current.strip() else " ".join(extra)


def set_cpu_flags() -> None:
    """Adds CPU_FLAGS to this process's XLA_FLAGS; effective only before JAX's backend
    starts (jtrain.boot.start calls it first thing)."""
    value = cpu_flags(os.environ)
    if value is not None:
        os.environ["XLA_FLAGS"] = value


def arena_cap(environ) -> int | None:
    """The malloc arena cap to set, or None: not glibc, `JTRAIN_MALLOC_ARENAS=0` (or not a
    number), or the user capped the arenas already (see the module doc)."""
    if "MALLOC_ARENA_MAX" in environ or \
            "glibc.malloc.arena_max=" in environ.get("GLIBC_TUNABLES", ""):
        return None
    try:
        cap = int(environ.get(ARENAS_ENV, DEFAULT_ARENAS))
    except ValueError:
        return None
    if cap <= 0 or glibc_version() is None:
        return None
    return cap


def limit_arenas() -> int | None:
    """Caps glibc's malloc arenas (`arena_cap`); effective for arenas made afterwards, so
    before the process starts threads (jtrain.boot.start calls it). The cap set, or None."""
    cap = arena_cap(os.environ)
    if cap is None:
        return None
    libc = _libc()
    return cap if libc is not None and libc.mallopt(M_ARENA_MAX, cap) == 1 else None


def _libc():
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        libc.mallopt  # noqa: B018 - it exists (glibc)
    except (OSError, AttributeError):
        return None
    return libc
