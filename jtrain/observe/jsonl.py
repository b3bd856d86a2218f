"""The format of WORKDIR/metrics.jsonl: one JSON object per line, `{"step": s, "time":
wall, "<name>": value, ...}`, non-finite values as the strings "nan", "inf", "-inf".
A resumed run drops the records after its restored step first (`truncate_after`), so
each step appears once."""

from __future__ import annotations

import json
import math
import os
import stat

from jtrain.errors import WorkdirError, first_line


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
    with open(path, "rb") as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        record, problem = _parse(line)
        if problem is None and keep(record):
            kept.append(line if line.endswith(b"\n") else line + b"\n")
    if len(kept) == len(lines):
        return
    from jtrain.observe import layout

    layout.write_file(path, b"".join(kept))


def last_byte(path: str) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1)


def read_records(path: str, check=None) -> list[dict]:
    """The records of a metrics.jsonl (or hashes.jsonl): JSON objects with an integer
    "step". A torn last line (a kill mid-write) is skipped. Without `check`, any other
    bad line (not UTF-8, not JSON, not an object, no integer step) is skipped too; with
    `check(record) -> problem or None`, a bad line is one WorkdirError naming the file,
    the line and the field. A path that is not a regular file is no records (or, with
    `check`, the error)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return []
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        if check is not None:
            raise WorkdirError(path, "not a regular file")
        return []
    os.set_blocking(fd, True)
    out = []
    with os.fdopen(fd, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            record, problem = _parse(line)
            if problem is None and check is not None:
                problem = check(record)
            if problem is None:
                out.append(record)
            elif check is not None and line.endswith(b"\n"):
                raise WorkdirError(f"{path}: line {number}", problem)
    return out


def parse_records(data: bytes) -> list[dict]:
    """The good records of a metrics.jsonl's bytes (read from elsewhere than a local
    file, e.g. a bucket): bad lines skipped, as read_records does without `check`."""
    parsed = [_parse(line) for line in data.splitlines() if line.strip()]
    return [record for record, problem in parsed if problem is None]


def _parse(line: bytes) -> tuple[dict, str | None]:
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        return {}, f"not UTF-8 (byte {e.start})"
    except (ValueError, RecursionError) as e:
        return {}, f"not JSON ({first_line(e)[:80]})"
    if not isinstance(record, dict):
        return {}, "not a JSON object"
    step = record.get("step")
    if type(step) is not int or step < 0:
        return {}, f"step: expected a non-negative integer, got {step!r:.40}"
    return record, None
