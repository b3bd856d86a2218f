"""Host memory behind XLA:CPU's per-step scratch buffer (docs/guide/host-memory.md; the
measurements: docs/benchmarks.md, "Memory and page faults of the base LM").

XLA:CPU mallocs the step's whole scratch space at each run and frees it after; glibc
serves it with fresh mmaps (4 KiB pages, ~84 k page faults per base-LM step) and no
malloc setting keeps it. Three settings, none of which changes a result:
- huge pages: `glibc.malloc.hugetlb=1` (glibc >= 2.35) is read only at process start,
  so jtrain's entry points re-execute themselves once with it in `GLIBC_TUNABLES`
  (`maybe_reexec`, from `jtrain.boot.start`; `JTRAIN_HUGETLB=0` turns it off);
- the plain scheduler: `--xla_cpu_enable_concurrency_optimized_scheduler=false` in
  `XLA_FLAGS` keeps fewer buffers alive at once (`set_cpu_flags`; a value the user put
  in `XLA_FLAGS` is kept);
- malloc arenas capped at 2 (`limit_arenas`, before any thread starts): each thread's
  arena keeps its own high-water mark; `JTRAIN_MALLOC_ARENAS=N` sets another cap, `0`
  glibc's default; a cap the user set is kept.
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
