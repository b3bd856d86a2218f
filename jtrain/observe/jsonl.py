"""The format of WORKDIR/metrics.jsonl: one JSON object per line, `{"step": s, "time":
wall, "<name>": value, ...}`, non-finite values as the strings "nan", "inf", "-inf".
A resumed run drops the records after its restored step first (`truncate_after`), so
each step appears once."""

from __future__ import annotations

import math

from jtrain.errors import WorkdirError
from jtrain.observe import runfiles


def json_float(v: float):
    if math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def truncate_after(path: str, step: int) -> None:
    """Drop the records of steps after `step` (a resumed run replays them) and torn
    lines; the rest stays byte for byte. Written beside, then renamed over."""
    _keep_only(path, lambda record: record["step"] <= step)


def drop_evals_after(path: str, step: int) -> None:
    """Drop the eval-only records (every value an eval/... metric) of steps after `step`
    (and torn lines): an eval.mode=async run resumed before it applied them writes them
    again."""
    _keep_only(path, lambda record: record["step"] <= step or not all(
        k.startswith("eval/") for k in record if k not in ("step", "time")))


def _keep_only(path: str, keep) -> None:
    data = runfiles.read_bytes(path, runfiles.LEDGER)
    kept = b"".join(line if line.endswith(b"\n") else line + b"\n"
                    for line, record in runfiles.ledger_lines(data, path, _check, bad=_skip)
                    if keep(record))
    if kept == data:
        return
    from jtrain.observe import layout

    layout.write_file(path, kept)


def last_byte(path: str) -> bytes:
    return runfiles.read_bytes(path, runfiles.LEDGER)[-1:]


def read_records(path: str, check=None) -> list[dict]:
    """The records of a metrics.jsonl (or hashes.jsonl): JSON objects with an integer
    "step". A torn last line (a kill mid-write) is skipped. Without `check`, any other
    bad line (not UTF-8, not JSON, not an object, no integer step) is skipped too, and a
    path that is not a readable regular file is no records; with `check(record) ->
    problem or None`, either is one WorkdirError naming the file, the line and the
    field (jtrain.observe.runfiles reads it)."""
    try:
        if check is None:
            return runfiles.read_ledger(path, _check, bad=_skip)
        return runfiles.read_ledger(path, lambda r: _check(r) or check(r))
    except FileNotFoundError:
        return []
    except WorkdirError:
        if check is not None:
            raise
        return []


def parse_records(data: bytes) -> list[dict]:
    """The good records of a metrics.jsonl's bytes (read from elsewhere than a local
    file, e.g. a bucket): bad lines skipped, as read_records does without `check`."""
    return runfiles.parse_ledger(data, "metrics.jsonl", _check, bad=_skip)


def _skip(message: str) -> None:
    """A bad line of a lenient read: left out (the strict readers name it)."""


def _check(record: dict) -> str | None:
    step = record.get("step")
    if type(step) is not int or step < 0:
        return f"step: expected a non-negative integer, got {step!r:.40}"
    return None
