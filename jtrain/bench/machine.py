"""What every benchmark records beside its numbers: the machine (CPU model, cores), the
jtrain commit, the date, and the load average before, during and after each measured
side or round. A measurement during which the load average exceeded the core count
shared the cores with other work: it is marked unreliable, in the printed table and in
the JSON (`"unreliable": true`), and kept (its per-round values stay in the JSON).

The load average is the kernel's 1-minute figure (`os.getloadavg()`), read before and
after a measurement and, while it runs, once a second by `LoadWatch` (a daemon thread)
or by the caller (`LoadWatch.sample()`, e.g. while waiting on a child process).
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def cores() -> int:
    """The machine's logical CPUs: what the (system-wide) load average is measured against."""
    return os.cpu_count() or 1


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":")[0].strip() in ("model name", "Model", "cpu model"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def commit() -> str:
    """`git rev-parse HEAD` (+ "-dirty") when jtrain runs from a checkout, else its version."""
    if (ROOT / ".git").exists():
        try:
            head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                                  capture_output=True, text=True, timeout=10)
            dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain",
                                    "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10)
            if head.returncode == 0:
                return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        from importlib.metadata import version

        return f"jtrain {version('jtrain')}"
    except Exception:
        return "unknown"


def machine() -> dict:
    """The record every benchmark's JSON carries under "machine"."""
    return {"cpu_model": cpu_model(), "cores": cores(),
            "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else cores(),
            "commit": commit(), "date": datetime.datetime.now().astimezone().isoformat(
                timespec="seconds"),
            "python": sys.version.split()[0], "platform": platform.platform(terse=True),
            "load_at_start": loadavg()}


def loadavg() -> float:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return float("nan")


def unreliable(loads, ncores: int) -> bool:
    """Whether any load average taken during a measurement exceeded the core count."""
    return any(x > ncores for x in loads if x == x)


def load_record(loads: list, ncores: int | None = None) -> dict:
    """{"load_before", "load_after", "load_max", "unreliable"} from the samples in order."""
    ncores = ncores or cores()
    if not loads:
        return {"load_before": None, "load_after": None, "load_max": None,
                "unreliable": False}
    return {"load_before": loads[0], "load_after": loads[-1], "load_max": max(loads),
            "unreliable": unreliable(loads, ncores)}


class LoadWatch:
    """The load average around one measurement: `with LoadWatch() as w: ...; w.record`.
    `thread=True` samples once a second in the background while the block runs."""

    def __init__(self, thread: bool = True, every_s: float = 1.0):
        self.loads: list[float] = []
        self._thread, self._every = thread, every_s
        self._stop = threading.Event()
        self._worker = None
        self.record: dict = {}

    def sample(self) -> None:
        self.loads.append(loadavg())

    def __enter__(self) -> "LoadWatch":
        self.sample()
        if self._thread:
            self._worker = threading.Thread(target=self._run, daemon=True,
                                            name="jtrain-bench-load")
            self._worker.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            self.sample()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._worker is not None:
            self._worker.join()
        self.sample()
        self.record = load_record(self.loads)


def any_unreliable(records) -> bool:
    return any(r.get("unreliable") for r in records if r)


def mark(record: dict | None) -> str:
    """The table's marker for a value measured under too much load: "!" (else "")."""
    return "!" if record and record.get("unreliable") else ""


def loads_line(records: list[dict], ncores: int | None = None) -> str:
    """One line for a report: the load range over the measurements and how many were
    unreliable."""
    ncores = ncores or cores()
    maxes = [r["load_max"] for r in records if r and r.get("load_max") is not None]
    bad = sum(1 for r in records if r and r.get("unreliable"))
    if not maxes:
        return "load average: not recorded"
    line = (f"load average (1 min) during the measurements: {min(maxes):.2f}-{max(maxes):.2f} "
            f"on {ncores} cores")
    if bad:
        line += (f"; {bad} of {len(records)} measurements UNRELIABLE (marked !: load above "
                 "the core count)")
    return line


def header_line(info: dict) -> str:
    return (f"machine: {info['cpu_model']}, {info['cores']} cores; jtrain {info['commit']}; "
            f"{info['date']}; load {info['load_at_start']:.2f} at start")
