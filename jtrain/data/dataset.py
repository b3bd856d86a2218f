"""`Data`: one dataset as jtrain reads it, and its example-level access."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jtrain.data import items as items_lib, pipeline
from jtrain.data.items import DataError


@dataclasses.dataclass
class Data:
    """One dataset as jtrain reads it. `kind`: "map" (source has len + read), "stream"
    (source opens per shard), "grain_loader" (source is the loader), "list" (an eval set
    read into memory, this process's rows)."""
    name: str
    kind: str
    source: Any
    description: str
    collate_fn: Callable | None = None
    worker_init_fn: Callable | None = None
    notes: list = dataclasses.field(default_factory=list)
    holdout: tuple | None = None  # streams: (fraction, split_seed, keep the held-out part)
    # Set only by `checks.check`, which returns a checked copy (the input is not changed):
    ref: dict | None = None       # the signature every batch must match
    sample: dict | None = None    # a checked sample batch (numpy, rows = examples)
    count: int | None = None      # examples, where known

    def __len__(self) -> int:
        """Examples (map-style: exact; streams: declared or seen, 0 if unknown)."""
        if self.kind == "map":
            return len(self.source)
        return int(self.count or 0)

    def __getitem__(self, index: int) -> dict:
        """Example `index` as the model sees it (after collate_fn), numpy."""
        if self.ref is None:
            raise DataError(f"{self.name}: not checked yet (jtrain.data.checks.check returns "
                            "the checked dataset)")
        if index == 0:
            return items_lib.tree_map(lambda x: x[0], self.sample)
        if self.kind not in ("map", "list"):
            raise DataError(f"{self.name}: a stream has no random access (only example 0 of "
                            "the checked sample)")
        batch = pipeline.collate([self.source.read(index)], [index], name=self.name,
                                 collate_fn=self.collate_fn, ref=self.ref,
                                 keep_64bit=items_lib.x64_enabled())
        return items_lib.tree_map(lambda x: x[0], batch)
