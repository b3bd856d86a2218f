"""The goodput ledger: where every second of a run went, over all its sessions.

A session is one call of the run (one process's start to its end, or to its kill). Its
wall time is cut into consecutive intervals, each given to exactly one category:

    startup      from the session's start (the process's, when it is the process's
                 first run) to its first step's result: observe.startup's phases
    steps        the loop between the marks below: dispatch, draining, logging; split
                 at the end into productive (kept) and recomputed (see below)
    compile      compiles after the first step (observe.compiles), cut out of
                 whichever interval holds them
    checkpoints  the time the loop blocks in a save (and in the last save's wait)
    eval         evaluations
    data         the loop's waits for its next batch
    other        the end of the session (its summary)

Across sessions: the steps a session computed beyond the checkpoint a later session
resumed from were recomputed there: their step seconds are *recomputed*, the rest are
*productive*; the time between a session's last record and the next session's start is
a *restart gap* (a killed session's last seconds, the process's exit, the scheduler).
The categories add up to the run's wall time, from the first session's start to the
last session's summary, by construction; goodput = productive / total.

WORKDIR/goodput.jsonl holds one line per session, each `WIDTH` bytes, updated in place
(process 0): after every step its head (the step, the time, the seconds per category:
fixed-width numbers, one small pwrite), at the first step, each eval and save its whole
line (the start-up phases, the checkpoints' step seconds). A SIGKILLed session's line is
therefore exact up to its last dispatched step; what it did after that step is part of
the gap. A session that finds the run finished already takes its line back.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import logging
import math
import os
import time

from jtrain.errors import WorkdirError
from jtrain.observe import layout, runfiles

FILE = "goodput.jsonl"
WIDTH = 2048  # bytes per session line, newline included
CATEGORIES = ("startup", "steps", "compile", "checkpoints", "eval", "data", "other")
_BEFORE_TRAIN = ("imports", "distributed")  # start-up phases before train(), per process
_MAX_SAVES = 32  # checkpoints' (step, step seconds) kept per session line
_HEAD = (b'{"step":%12d,"end":%18.6f,'
         + b",".join(b'"%s":%%18.6f' % c.encode() for c in CATEGORIES) + b",")
_sessions_in_process = 0  # the first one also counts the imports before train()


class Ledger:
    """This session's record. `t_start`: time.perf_counter() at train()'s entry;
    `startup`: observe.startup.Startup (its phases, its compile recorder);
    `first_step`: the step it resumed from (0: a fresh start)."""

    def __init__(self, workdir: str, *, t_start: float, startup, first_step: int,
                 primary: bool = True):
        global _sessions_in_process
        self._startup = startup
        self._recorder = getattr(startup, "recorder", None)
        self._first_in_process = _sessions_in_process == 0
        _sessions_in_process += 1
        now = time.perf_counter()
        self._offset = time.time() - now  # perf_counter -> unix time, fixed per session
        before = (sum(startup.seconds.get(p, 0.0) for p in _BEFORE_TRAIN)
                  if self._first_in_process else 0.0)
        self.start = t_start + self._offset - before
        self.first_step = self.step = int(first_step)
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self.seconds["startup"] = now + self._offset - self.start
        self.phases: dict[str, float] = {}
        self.saves: list[list] = []  # [step, step seconds when it was saved]
        self.done = False
        self._mark, self._compiled, self._started = now, 0.0, False
        self._previous: list[dict] = []
        self._file: io.FileIO | None = None
        self._at = 0  # this session's line's offset in the file
        if primary:
            self._open(os.path.join(workdir, FILE))
        self._write(full=True)

    def _open(self, path: str) -> None:
        self._file = io.FileIO(layout.open_update(path), "r+")
        size = os.fstat(self._file.fileno()).st_size
        self._at = size - size % WIDTH  # a torn last line (a crash mid-append) is replaced
        if self._at > runfiles.LEDGER[1]:
            self.close()
            raise WorkdirError(path, f"larger than {runfiles.LEDGER[1]} bytes, the cap for "
                               f"a {runfiles.LEDGER[0]}")
        self._file.seek(0)
        self._previous = _records(self._file.read(self._at), path)

    # -- the marks the loop sets ------------------------------------------------------

    def step_done(self, step: int, data_wait: float, first: bool) -> None:
        """After each step's dispatch: the interval since the last mark is start-up (the
        session's first step) or step time, less its data wait and compiles."""
        if first:
            self._attribute("startup")
            self._started = True
            self._compiled = self._compile_sec()
            self.phases = {p: round(s, 6) for p, s in self._startup.seconds.items()
                           if self._first_in_process or p not in _BEFORE_TRAIN}
        else:
            self._attribute("steps", data_wait)
        self.step = step
        self._write(full=first)

    @contextlib.contextmanager
    def phase(self, name: str, saved: int | None = None):
        """An eval or a save ("eval", "checkpoints"); `saved`: the step a save wrote,
        with the step seconds up to it (what a later session's resume keeps)."""
        self._attribute("steps" if self._started else "startup")
        try:
            yield
        finally:
            self._attribute(name)
            if saved is not None:
                self.saves = (self.saves + [[int(saved), round(self.seconds["steps"], 6)]]
                              )[-_MAX_SAVES:]
            self._write(full=True)

    def finish(self) -> dict:
        """The session's end: its line completed; the run's block for summary.json."""
        self._attribute("other" if self._started else "startup")
        self.done = True
        self._write(full=True)
        self.close()
        return block(self._previous + [self.record()])

    def discard(self) -> None:
        """A session that did nothing (the run had finished): its line taken back."""
        if self._file is not None:
            self._file.truncate(self._at)
        self.close()

    def close(self) -> None:
        """The file closed, whatever ended the session (finish and discard close it too;
        a halt or an error leaves this session's line as its last write left it)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- bookkeeping ------------------------------------------------------------------

    def _compile_sec(self) -> float:
        return float(getattr(self._recorder, "compile_sec", 0.0) or 0.0)

    def _attribute(self, category: str, data_wait: float = 0.0) -> None:
        """The time since the last mark to `category`, compiles after the first step
        and the given data wait cut out of it."""
        now = time.perf_counter()
        dt, self._mark = now - self._mark, now
        compiled = 0.0
        if self._started:
            total = self._compile_sec()
            compiled, self._compiled = min(max(total - self._compiled, 0.0), dt), total
        waited = min(max(data_wait, 0.0), dt - compiled)
        self.seconds["compile"] += compiled
        self.seconds["data"] += waited
        self.seconds[category] += dt - compiled - waited

    def record(self) -> dict:
        return {"step": self.step, "end": self._mark + self._offset, **self.seconds,
                "session": len(self._previous), "start": self.start,
                "first_step": self.first_step, "phases": self.phases,
                "saves": self.saves, "done": self.done}

    def _write(self, full: bool) -> None:
        if self._file is None:
            return
        head = _HEAD % (self.step, self._mark + self._offset,
                        *(min(self.seconds[c], 1e10) for c in CATEGORIES))
        if not full:
            os.pwrite(self._file.fileno(), head, self._at)
            return
        saves = self.saves
        while True:
            tail = json.dumps({"session": len(self._previous), "start": self.start,
                               "first_step": self.first_step, "phases": self.phases,
                               "saves": saves, "done": self.done})[1:].encode()
            if len(head) + len(tail) < WIDTH or not saves:
                break
            saves = saves[1:]
        os.pwrite(self._file.fileno(), (head + tail).ljust(WIDTH - 1) + b"\n", self._at)


def _steps_at(record: dict, step: int) -> float:
    """A session's step seconds up to `step` (exact at its saves; between two known
    points, in proportion)."""
    known = sorted({record["first_step"]: 0.0, record["step"]: record["steps"],
                    **{s: t for s, t in record["saves"]}}.items())
    if step <= known[0][0]:
        return 0.0
    for (s0, t0), (s1, t1) in itertools.pairwise(known):
        if step <= s1:
            return t0 + (t1 - t0) * (step - s0) / max(s1 - s0, 1)
    return record["steps"]


SESSION_KEYS = ("productive", "startup", "compile", "checkpoints", "eval", "data",
                "recomputed", "restart_gaps", "other")


def sessions(records: list[dict]) -> list[dict]:
    """Each session's seconds by category (SESSION_KEYS; `restart_gaps`: the gap before
    it), with its steps computed and recomputed (those a later session computed again)."""
    later = [math.inf] * len(records)  # the least first step of the sessions after each
    for i in range(len(records) - 2, -1, -1):  # one pass back: linear in the sessions
        later[i] = min(later[i + 1], records[i + 1]["first_step"])
    rows = []
    for i, r in enumerate(records):
        row = dict.fromkeys(SESSION_KEYS, 0.0)
        for c in ("startup", "compile", "checkpoints", "eval", "data", "other"):
            row[c] = r[c]
        recomputed, recomputed_steps = 0.0, 0
        if r["step"] > later[i]:  # a later session computed these again
            kept = max(later[i], r["first_step"])
            recomputed_steps = r["step"] - kept
            recomputed = r["steps"] - _steps_at(r, kept)
        row["recomputed"] = recomputed
        row["productive"] = r["steps"] - recomputed
        if i:
            row["restart_gaps"] = max(r["start"] - records[i - 1]["end"], 0.0)
        rows.append({"seconds": row, "computed": r["step"] - r["first_step"],
                     "recomputed": recomputed_steps})
    return rows


def block(records: list[dict]) -> dict:
    """summary.json's "goodput": seconds per category over the sessions (in order), the
    steps kept and recomputed, the fraction; `other` is what no category holds."""
    seconds = dict.fromkeys(SESSION_KEYS, 0.0)
    phases: dict[str, float] = {}
    for r in records:
        for p, s in r["phases"].items():
            phases[p] = phases.get(p, 0.0) + s
    rows = sessions(records)
    for row in rows:
        for k, v in row["seconds"].items():
            seconds[k] += v
    total = records[-1]["end"] - records[0]["start"]
    seconds["other"] += total - sum(seconds.values())  # clock residue; 0 up to rounding
    return {"fraction": round(seconds["productive"] / total, 4) if total > 0 else 0.0,
            "total_sec": round(total, 3), "sessions": len(records),
            "seconds": {k: round(v, 3) for k, v in seconds.items()},
            "startup_phases": {k: round(v, 3) for k, v in phases.items()},
            "steps": {"computed": sum(r["computed"] for r in rows),
                      "recomputed": sum(r["recomputed"] for r in rows)},
            "start": records[0]["start"], "end": records[-1]["end"]}


def read(workdir: str) -> list[dict]:
    """The session records of WORKDIR/goodput.jsonl, in order (a torn last line skipped,
    a malformed record skipped with a warning); a link, a FIFO or a file over the cap is
    one WorkdirError (jtrain.observe.runfiles)."""
    path = os.path.join(workdir, FILE)
    return _records(runfiles.read_bytes(path, runfiles.LEDGER), path)


_FIELDS = {"step": int, "end": float, **dict.fromkeys(CATEGORIES, float), "start": float,
           "first_step": int, "phases": dict, "saves": list}


def _records(data: bytes, path: str) -> list[dict]:
    """A malformed record (a hand edit, a foreign file) is skipped with a warning: the
    ledger only reports, so it never fails a run that trained, nor its evaluation."""
    return runfiles.parse_ledger(data, path, _check, bad=_warn)


def _check(record: dict) -> str | None:
    problem = runfiles.check_fields(record, _FIELDS)
    if problem is None:
        problem = runfiles.check_fields(record["phases"], dict.fromkeys(record["phases"],
                                                                        float))
        problem = problem and f"phases.{problem}"
    if problem is None and not all(
            isinstance(s, list) and len(s) == 2 and type(s[0]) is int
            and runfiles.check_fields({"t": s[1]}, {"t": float}) is None
            for s in record["saves"]):
        problem = "saves: expected a list of [step, seconds]"
    return problem


def _warn(message: str) -> None:
    logging.warning("jtrain: goodput: %s", message)


def _sec(s: float) -> str:
    if s < 600:
        return f"{s:.2f} s" if s < 10 else f"{s:.1f} s"
    return f"{s / 60:.1f} min" if s < 36000 else f"{s / 3600:.1f} h"


def line(goodput: dict) -> str:
    """The end-of-run line."""
    s, n = goodput["seconds"], goodput["sessions"]
    recomputed = goodput["steps"]["recomputed"]
    return (f"jtrain: goodput {100 * goodput['fraction']:.1f}% of {_sec(goodput['total_sec'])}"
            f" over {n} session{'s' if n != 1 else ''}: start-up {_sec(s['startup'])}, "
            f"compile {_sec(s['compile'])}, checkpoints {_sec(s['checkpoints'])}, "
            f"eval {_sec(s['eval'])}, data {_sec(s['data'])}, recomputed {_sec(s['recomputed'])}"
            f" ({recomputed} step{'s' if recomputed != 1 else ''}), restart gaps "
            f"{_sec(s['restart_gaps'])}, other {_sec(s['other'])}")
