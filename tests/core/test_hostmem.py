"""jtrain.hostmem: jtrain's entry points restart once with huge-page malloc (the XLA:CPU
step's scratch buffer is mapped fresh every step); JTRAIN_HUGETLB=0 and a tunable the user
set already leave the process alone."""

import pytest

from jtrain import hostmem
from journey import run_python

CAN = hostmem.tunables_with_hugetlb({}) is not None  # glibc >= 2.35 and THP available

# A config file that reports the environment the training process really runs in.
CONFIG = '''import os
from jtrain.config import defaults


def get_config():
    with open("env.txt", "w") as f:
        f.write(os.environ.get("GLIBC_TUNABLES", "-"))
    return defaults(model="mlp")
'''


def test_tunable_value():
    if not CAN:
        pytest.skip("no glibc >= 2.35 with transparent huge pages here")
    assert hostmem.tunables_with_hugetlb({}) == "glibc.malloc.hugetlb=1"
    assert hostmem.tunables_with_hugetlb({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) \
        == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    for env in ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, {"JTRAIN_HUGETLB": "0"},
                {"JTRAIN_HUGETLB_REEXEC": "1"}):
        assert hostmem.tunables_with_hugetlb(env) is None, env


def test_cli_runs_with_huge_page_malloc(tmp_path):
    (tmp_path / "cfg.py").write_text(CONFIG)
    proc = run_python(tmp_path, "-m", "jtrain.main", "--config=cfg.py")  # no --workdir
    assert proc.returncode == 2 and "workdir" in proc.stderr, proc.stderr[-2000:]
    seen = (tmp_path / "env.txt").read_text()
    assert seen == ("glibc.malloc.hugetlb=1" if CAN else "-")


def test_failed_exec_leaves_signals_as_they_were(monkeypatch):
    import signal

    if not CAN:
        pytest.skip("no glibc >= 2.35 with transparent huge pages here")
    calls = []

    def refuse(*args):
        calls.append(args)
        raise OSError("exec not allowed here")

    for key in ("GLIBC_TUNABLES", "JTRAIN_HUGETLB", "JTRAIN_HUGETLB_REEXEC"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(hostmem.os, "execve", refuse)
    hostmem.maybe_reexec()
    assert len(calls) == 1 and calls[0][2]["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert signal.SIGTERM not in blocked and signal.SIGINT not in blocked


def test_cpu_flags_added_unless_xla_flags_names_them():
    flag = "--xla_cpu_enable_concurrency_optimized_scheduler"
    assert hostmem.cpu_flags({}) == f"{flag}=false"
    assert hostmem.cpu_flags({"XLA_FLAGS": "--xla_dump_to=/d"}) == f"--xla_dump_to=/d {flag}=false"
    assert hostmem.cpu_flags({"XLA_FLAGS": f"{flag}=true"}) is None  # the user's choice stays
    assert hostmem.cpu_flags({"XLA_FLAGS": f"--a=1 {flag}=false"}) is None


def test_entry_points_start_with_the_cpu_flags(tmp_path):
    code = ("from jtrain import boot; boot.start('bench'); import os, sys; "
            "print(os.environ['XLA_FLAGS'], 'jax' in sys.modules)")
    proc = run_python(tmp_path, "-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["--xla_cpu_enable_concurrency_optimized_scheduler=false",
                                   "False"]


def test_arena_cap_unless_the_user_chose():
    if hostmem.glibc_version() is None:
        pytest.skip("not glibc")
    assert hostmem.arena_cap({}) == 2
    assert hostmem.arena_cap({"JTRAIN_MALLOC_ARENAS": "4"}) == 4
    for env in ({"JTRAIN_MALLOC_ARENAS": "0"}, {"JTRAIN_MALLOC_ARENAS": "x"},
                {"MALLOC_ARENA_MAX": "8"}, {"GLIBC_TUNABLES": "glibc.malloc.arena_max=8"}):
        assert hostmem.arena_cap(env) is None, env


# Threads that allocate after boot.start, alive together (on a loaded machine threads
# run one after another and reuse a finished one's arena): glibc's malloc_info lists one
# <heap> per arena.
ARENAS = '''import ctypes, sys, threading
from jtrain import boot
boot.start("bench")
together = threading.Barrier(8)
def work():  # all alive at once: a finished thread's arena is not handed to the next
    blocks = [bytearray(200_000) for _ in range(50)]
    together.wait()
threads = [threading.Thread(target=work) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
libc = ctypes.CDLL(None)
libc.fflush(None)
libc.malloc_info(0, ctypes.c_void_p.in_dll(libc, "stdout"))
'''


def test_entry_points_cap_the_malloc_arenas(tmp_path):
    if hostmem.glibc_version() is None:
        pytest.skip("not glibc")
    counts = []
    for value in ("2", "0"):  # capped (the default), glibc's own (one per thread here)
        proc = run_python(tmp_path, "-c", ARENAS, JTRAIN_MALLOC_ARENAS=value)
        assert proc.returncode == 0, proc.stderr
        counts.append(proc.stdout.count("<heap nr="))
    assert counts[0] <= 2 < counts[1], counts
