"""Sequence packing (data.packing): variable-length token documents -> windows of
data.seq_len tokens with `segment_ids` and per-segment `positions`.

A document is a 1-D integer array (or a dict holding one under `tokens`, and optionally
per-token `weights` of the same length: a target's weight is its token's, e.g. 0 on a
chat's prompt tokens, chat.py). A document of
L tokens gives L - 1 (input, target) pairs, token i predicting token i + 1 of the same
document, so no target ever crosses a document boundary. A document with more than
seq_len pairs is cut into pieces of at most seq_len pairs (each piece its own segment).

    pad        one piece per window, padded (the baseline packing is measured against)
    concat     pieces in order, cut at window boundaries (a cut piece continues in the
               next window as a new segment)
    first_fit  documents in a seeded order, each piece into the first of at most
               `buffer` open windows with room (else a new window; the oldest window
               closes when more than `buffer` are open)

A window is an item {"inputs", "targets", "weights", "segment_ids", "positions"}, all
[seq_len]: segment ids count 1, 2, ... within the window (0 = padding), positions count
0, 1, ... within each segment, weights are 1 (or the document's) on tokens and 0 on
padding. The plan of windows is computed once, from every document's length (each
document is read once for it); it depends only on the lengths, the mode and the seed, so
the packed data is a plain map-style dataset: shuffling, exact resume and the
process-count independence of the pipeline (pipeline.py) hold unchanged.
"""

from __future__ import annotations

import numpy as np

from jtrain.data.items import DataError
from jtrain.data.sources import call_item

MODES = ("none", "pad", "concat", "first_fit")


def doc_tokens(item, where: str) -> np.ndarray:
    """A document's tokens as a 1-D integer numpy array."""
    if isinstance(item, dict):
        if "tokens" not in item:
            raise DataError(f"{where}: data.packing needs documents that are 1-D token "
                            f"arrays or dicts with 'tokens'; got fields {sorted(item)}")
        item = item["tokens"]
    if hasattr(item, "detach"):
        item = item.detach().cpu().numpy()
    arr = np.asarray(item)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise DataError(f"{where}: data.packing needs 1-D integer token arrays; got "
                        f"{arr.dtype} of shape {arr.shape}")
    return arr.astype(np.int32)


def pieces_of(lengths, seq_len: int, order) -> list[tuple[int, int, int]]:
    """(document, first pair, pairs) pieces of at most seq_len pairs, documents in `order`."""
    out = []
    for d in order:
        pairs = int(lengths[d]) - 1
        for start in range(0, pairs, seq_len):
            out.append((int(d), start, min(seq_len, pairs - start)))
    return out


def plan(lengths, seq_len: int, mode: str, *, seed: int = 0, buffer: int = 64) -> list:
    """Windows, each a list of (document, first pair, pairs) segments."""
    n = len(lengths)
    if mode == "pad":
        return [[p] for p in pieces_of(lengths, seq_len, range(n))]
    if mode == "concat":
        windows, current, room = [], [], seq_len
        for d, start, pairs in pieces_of(lengths, seq_len, range(n)):
            while pairs:
                take = min(pairs, room)
                current.append((d, start, take))
                start, pairs, room = start + take, pairs - take, room - take
                if room == 0:
                    windows.append(current)
                    current, room = [], seq_len
        return windows + ([current] if current else [])
    if mode == "first_fit":
        order = np.random.default_rng([seed, 0xFF17]).permutation(n)
        windows, open_ = [], []  # open_: [segments, room] in opening order
        for piece in pieces_of(lengths, seq_len, order):
            for slot in open_:
                if slot[1] >= piece[2]:
                    slot[0].append(piece)
                    slot[1] -= piece[2]
                    break
            else:
                open_.append([[piece], seq_len - piece[2]])
                if len(open_) > buffer:
                    windows.append(open_.pop(0)[0])
        return windows + [slot[0] for slot in open_]
    raise DataError(f"data.packing: unknown mode {mode!r}; choose one of {', '.join(MODES)}")


class Packed:
    """Map-style packed windows of a map-style dataset of documents."""

    def __init__(self, docs, seq_len: int, mode: str, *, name: str, seed: int = 0,
                 buffer: int = 64):
        if not (hasattr(docs, "__len__") and hasattr(docs, "__getitem__")):
            raise DataError(f"{name}: data.packing is implemented for map-style documents "
                            f"(len + getitem), not {type(docs).__name__}")
        self.docs, self.seq_len, self.mode, self.name = docs, seq_len, mode, name
        lengths = [len(self._doc(i)[0]) for i in range(len(docs))]
        if not lengths:
            raise DataError(f"{name}: no documents to pack")
        if max(lengths) < 2:
            raise DataError(f"{name}: every document has fewer than 2 tokens (nothing to "
                            "predict)")
        self.windows = plan(lengths, seq_len, mode, seed=seed, buffer=buffer)
        self.num_tokens = sum(n - 1 for n in lengths if n > 1)

    def _doc(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        """(tokens, per-token weights or None) of document i."""
        where = f"{self.name}[{i}]"
        item = call_item(lambda: self.docs[i], where)
        tokens = doc_tokens(item, where)
        weights = item.get("weights") if isinstance(item, dict) else None
        if weights is not None:
            weights = np.asarray(weights, np.float32)
            if weights.shape != tokens.shape:
                raise DataError(f"{where}: weights of shape {weights.shape} for "
                                f"{len(tokens)} tokens")
        return tokens, weights

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index) -> dict:
        t = self.seq_len
        out = {k: np.zeros(t, np.int32) for k in ("inputs", "targets", "segment_ids",
                                                   "positions")}
        weights = np.zeros(t, np.float32)
        at = 0
        for seg, (d, start, pairs) in enumerate(self.windows[int(index)], 1):
            tokens, doc_weights = self._doc(d)
            out["inputs"][at:at + pairs] = tokens[start:start + pairs]
            out["targets"][at:at + pairs] = tokens[start + 1:start + pairs + 1]
            out["segment_ids"][at:at + pairs] = seg
            out["positions"][at:at + pairs] = np.arange(pairs)
            weights[at:at + pairs] = 1.0 if doc_weights is None else \
                doc_weights[start + 1:start + pairs + 1]
            at += pairs
        out["weights"] = weights
        return out

    def fill(self) -> float:
        """Share of window positions holding a token (1.0 = no padding)."""
        return self.num_tokens / max(1, len(self.windows) * self.seq_len)

    def __repr__(self) -> str:  # deterministic: grain compares reprs on restore
        return f"Packed({self.name}, {self.mode}, n={len(self)}, seq_len={self.seq_len})"


def note(packed) -> list:
    """The header's line for packed data ([] when not packed)."""
    if not isinstance(packed, Packed):
        return []
    return [f"packed ({packed.mode}): {len(packed.docs):,} documents -> {len(packed):,} "
            f"windows of {packed.seq_len}, {packed.fill():.0%} tokens (the rest padding)"]


def pack(docs, data_cfg, name: str):
    """`docs` packed per data.packing (itself when "none")."""
    mode = data_cfg.packing
    if mode == "none" or docs is None:
        return docs
    return Packed(docs, data_cfg.seq_len, mode, name=name, seed=data_cfg.split_seed,
                  buffer=data_cfg.packing_buffer)
