"""Stream components of a mixture (a torch IterableDataset, a grain IterDataset, any
re-iterable object): consumed in order, the same on any number of processes.

The n-th draw of a stream component is its n-th element (global, not per process): the
slots of global batch b that draw the component (mixture.py) take its next elements in
slot order. Every process reads the whole stream in order (one reader in the main
thread, shard 0 of 1 for a stream that splits itself) and keeps the elements that fall
in its own slots, so the global batch does not depend on the number of processes; the
cost is that each process reads every element of every stream component.

When a stream ends, its next epoch re-iterates it (calling `set_epoch` where it has
one); a stream whose new pass yields nothing is a DataError naming the component. The
data state adds each stream's cursor: its epoch, the raw elements read in that epoch
(or a grain iterator's own state) and its draws. A resume re-opens the stream and
skips to that element (streams.ShardStream.restore), so the stream must give the same
elements in the same order for the same epoch, as for a stream alone.
"""

from __future__ import annotations

import numpy as np

from jtrain.data import pipeline, streams
from jtrain.data.items import DataError
from jtrain.losses import ROW_MASK


class StreamCursor:
    """One stream component read in order, epoch after epoch."""

    def __init__(self, data, where: str, seed: int):
        self.where = where
        self.shard = streams.ShardStream(data.source, shard=0, num_shards=1, seed=seed,
                                         holdout=data.holdout)
        self.draws, self.in_epoch = 0, 0

    def take(self, count: int) -> list:
        out: list = []
        while len(out) < count:
            try:
                item, _ = self.shard.next()
            except streams.EpochEnd:
                if self.in_epoch == 0:
                    raise DataError(f"{self.where}: the stream yielded no element in epoch "
                                    f"{self.shard.epoch}; a stream component starts each "
                                    "epoch by iterating it again, so it must start a new "
                                    "pass each time (a one-shot iterator cannot)") from None
                self.shard.end_epoch()
                self.in_epoch = 0
                continue
            out.append(item)
            self.in_epoch += 1
        self.draws += count
        return out

    @property
    def epochs(self) -> int:
        """Completed passes (an epoch counts once its end has been read)."""
        return self.shard.epoch

    def state(self) -> dict:
        return {**streams._jsonable(self.shard.state()), "draws": self.draws,
                "in_epoch": self.in_epoch}

    def restore(self, state: dict) -> None:
        self.shard.restore(state)
        self.draws, self.in_epoch = int(state["draws"]), int(state["in_epoch"])


def check_kind(state, name: str) -> None:
    """A DataError unless `state` is a mixture's saved data position."""
    if not isinstance(state, dict) or state.get("kind") != "mixture":
        raise DataError(f"{name}: the checkpoint's data position is not one of a "
                        "mixture; the data changed kind since it was saved (use a new "
                        "workdir)")


class StreamMixtureIterator:
    """Endless per-process batches of a mixture with stream components, read in order in
    the caller's thread. The position is the global batches consumed (as for any
    mixture) plus each stream's cursor at it."""

    def __init__(self, plan, reader: pipeline.BatchReader, stream_parts: dict):
        self.plan, self.reader = plan, reader
        names = plan.source.names
        self.cursors = {c: StreamCursor(d, f"data.mixture.{names[c]}", reader.seed)
                        for c, d in stream_parts.items()}
        self.position = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        p, number = self.plan, self.position
        row, before = p.row(number), p.counts_before(number)  # [B], [K]
        lo, hi = p.offset, p.offset + p.local_batch
        raws: list = [None] * p.local_batch
        keys = np.zeros(p.local_batch, np.int64)
        for c, cursor in self.cursors.items():
            slots = np.flatnonzero(row == c)
            if cursor.draws != before[c]:  # a bug, never the user's data
                raise RuntimeError(f"stream cursor {c} at {cursor.draws}, plan {before[c]}")
            for rank, (slot, item) in enumerate(zip(slots, cursor.take(len(slots)), strict=True)):
                if lo <= slot < hi:  # this process's slot: keep the element
                    raws[slot - lo], keys[slot - lo] = item, int(before[c]) + rank
        mine = [j for j in range(p.local_batch) if int(row[lo + j]) not in self.cursors]
        for j in mine:
            slot = lo + j
            c = int(row[slot])
            keys[j] = p.index(c, int(before[c]) + int(np.count_nonzero(row[:slot] == c)))
        items = p.source.read_batch(keys[mine], 0, self.reader.seed, number,
                                    self.reader.stream) if mine else []
        for j, item in zip(mine, items, strict=True):
            raws[j] = item
        r = self.reader
        batch = pipeline.collate(raws, keys, name=r.name, collate_fn=r.collate_fn,
                                 ref=r.ref, keep_64bit=r.keep_64bit)
        if r.mask:
            batch[ROW_MASK] = np.ones(p.local_batch, np.float32)
        self.position += 1
        return batch

    def get_state(self) -> dict:
        p = self.plan
        draws = p.counts_before(self.position)
        sizes = ["stream" if c in self.cursors else int(n)
                 for c, n in enumerate(p.source.sizes)]
        return {"kind": "mixture", "position": self.position,
                "components": list(p.source.names), "sizes": sizes,
                "global_batch": p.global_batch, "draws": draws.tolist(),
                "epochs": [self.cursors[c].epochs if c in self.cursors else int(d) // int(n)
                           for c, (d, n) in enumerate(zip(draws, p.source.sizes, strict=True))],
                "streams": {p.source.names[c]: cur.state() for c, cur in self.cursors.items()}}

    def set_state(self, state: dict) -> None:
        p, name = self.plan, self.reader.name
        check_kind(state, name)
        now = self.get_state()
        saved = (state.get("components"), state.get("sizes"), state.get("global_batch"))
        if saved != (now["components"], now["sizes"], now["global_batch"]):
            raise DataError(f"{name}: the checkpoint's mixture is {saved[0]} of sizes "
                            f"{saved[1]}, global batch {saved[2]}; this run has "
                            f"{now['components']}, {now['sizes']}, {now['global_batch']} "
                            "(restore them or use a new workdir)")
        self.position = int(state["position"])
        draws = p.counts_before(self.position)
        for c, cursor in self.cursors.items():
            cursor.restore(state["streams"][p.source.names[c]])
            if cursor.draws != draws[c]:
                raise DataError(f"{name}: the checkpoint's stream position of "
                                f"{p.source.names[c]} ({cursor.draws} draws) does not match "
                                f"its batch position ({int(draws[c])}); use a new workdir")

    def close(self) -> None:
        pass
