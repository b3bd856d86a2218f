"""The format of WORKDIR/metrics.jsonl: one JSON object per line, `{"step": s, "time":
wall, "<name>": value, ...}`, non-finite values as the strings "nan", "inf", "-inf".
A resumed run drops the records after its restored step first (`truncate_after`), so
each step appears once."""

from __future__ import annotations

import json
import math
import os


def json_float(v: float):
    if math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def truncate_after(path: str, step: int) -> None:
    """Drop the records of steps after `step` (a resumed run replays them) and torn
    lines; the rest stays byte for byte. Written beside, then renamed over."""
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            if int(json.loads(line)["step"]) <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
        except (ValueError, KeyError, TypeError):
            continue
    if len(kept) == len(lines):
        return
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)


def last_byte(path: str) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1)


def read_records(path: str) -> list[dict]:
    """Records of a metrics.jsonl; a torn line (a kill mid-write) is skipped."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out
