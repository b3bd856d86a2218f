"""The skip ledger: every step whose update was skipped, why, and which examples.

The jitted step decides (`jtrain.step`: non-finite loss or gradients, an invalid batch)
and reports a status per step; the loop reads it for every step it drains, in order,
and turns a skip into one warning line and one ledger entry:

    {"step": 17, "reason": "invalid batch", "batch": 16, "examples": [803, 12]}

`batch` is the global batch number (the data position), `examples` the indices of the
offending rows in the dataset the user passed (for an invalid batch: the invalid rows;
for a non-finite loss or gradient: the whole batch), when the data is map-style (a
stream has no global index: `rows` gives the rows of the batch instead). The ledger is written to
`WORKDIR/skipped.jsonl` by process 0 and carried in the checkpoint's run-control record;
on resume the file is rewritten from the restored record, so entries of replayed steps
appear once.
"""

from __future__ import annotations

import json
import os

from jtrain import step as step_lib
from jtrain.observe import layout

FILE = "skipped.jsonl"
KEEP = 10_000  # entries carried in the checkpoint (the file keeps them all)


def reason(status: int) -> str:
    if status & step_lib.INVALID_BATCH:
        return "invalid batch"
    if status & step_lib.BAD_LOSS:
        return "non-finite loss"
    return "non-finite gradients"


class Ledger:
    def __init__(self, workdir: str, entries: list, *, primary: bool, resumed_step: int | None):
        self.path = os.path.join(workdir, FILE)
        self.primary = primary
        self.entries = [e for e in entries if resumed_step is None or e["step"] <= resumed_step]
        if primary:  # the file restarts from what the checkpoint knows
            layout.write_file(self.path, "".join(json.dumps(e) + "\n" for e in self.entries))

    def add(self, *entries: dict) -> None:
        """Append entries (one file write for all of them, e.g. a rollback's steps)."""
        self.entries.extend(entries)
        del self.entries[:-KEEP]
        if self.primary:
            with layout.open_append(self.path) as f:
                f.writelines(json.dumps(e) + "\n" for e in entries)


def entry(step: int, status: int, *, batch: int | None, rows_ok, indices) -> dict:
    """One ledger entry. `rows_ok`: [B] bools from the step; `indices`: the global
    example indices of the batch (None for a stream)."""
    why = reason(status)
    rows = [i for i, ok in enumerate(rows_ok) if not ok] if why == "invalid batch" \
        else list(range(len(rows_ok)))
    out = {"step": int(step), "reason": why}
    if batch is not None:
        out["batch"] = int(batch)
    if indices is not None:
        out["examples"] = [int(indices[r]) for r in rows if r < len(indices)]
    else:
        out["rows"] = rows
    return out
