"""Token shards: text tokenized once (`jtrain tokenize`), read by every run
(data.name="tokens", data.path=DIR).

A folder of shards holds

    shard-00000.bin ...  the token ids, raw little-endian uint16 (a vocabulary of at most
                         65,536) or uint32, each document followed by the tokenizer's
                         separator (if it has one); memory-mapped with numpy, so a run
                         reads only the windows it draws and grain's workers share the
                         page cache
    index.json           format, dtype, vocab_size, eos, the tokenizer (kind, file,
                         fingerprint = the file's SHA-256), each shard's file, token
                         count and SHA-256, and the fingerprint over all of them
    tokenizer.json | tokenizer.model   the tokenizer's copy (none for bytes)

Opening checks the whole chain (index fingerprint, tokenizer file, each shard's size and
SHA-256): a changed file is one DataError naming it. The train source serves windows of
data.seq_len + 1 tokens inside each shard, like the byte corpus (jtrain/data/text.py):
map-style, so grain's index sampler gives exact resume and per-process sharding.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from typing import Iterator

import numpy as np

from jtrain.data import text, tokenizer as tokenizer_lib
from jtrain.data.items import DataError

INDEX = "index.json"
FORMAT, VERSION = "jtrain.tokens", 1
SHARD_TOKENS = 1 << 26  # 128 MiB of uint16 per shard


def input_files(spec: str) -> list[str]:
    """--input: comma-separated files or globs -> the files, each glob sorted."""
    files: list[str] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        matched = sorted(glob.glob(part, recursive=True)) if glob.has_magic(part) else [part]
        if not matched or not all(os.path.isfile(f) for f in matched):
            missing = next((f for f in matched if not os.path.isfile(f)), part)
            raise DataError("--input", f"{missing}: no such file")
        files += matched
    if not files:
        raise DataError("--input", "no input files given")
    return files


def documents(path: str, text_field: str = "text") -> Iterator[str]:
    """The documents of one file: a .jsonl line's `text_field`, a .parquet column of that
    name (needs pyarrow), else the whole file as UTF-8 text."""
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(path, "reading Parquet needs pyarrow (pip install pyarrow)") \
                from None
        table = pq.read_table(path)
        if text_field not in table.column_names:
            raise DataError(path, f"no column {text_field!r} (--text_field)")
        yield from (str(v) for v in table.column(text_field).to_pylist() if v is not None)
        return
    with open(path, "rb") as f:
        raw = f.read()
    try:
        content = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(path, f"not UTF-8 text (byte {e.start})") from None
    if not path.endswith(".jsonl"):
        yield content
        return
    for number, record in json_lines(path, content):
        value = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(value, str):
            raise DataError(f"{path}:{number}", f"no string field {text_field!r} "
                            "(--text_field)")
        yield value


def json_lines(path: str, content: str) -> Iterator[tuple[int, object]]:
    """(line number, JSON value) of each non-blank line of a JSONL file's `content`; a
    line that is not JSON is a DataError naming the file and the line."""
    for number, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{number}", f"not JSON ({e.msg})") from None


def write_shards(tok, docs, out: str, shard_tokens: int = SHARD_TOKENS) -> dict:
    """Encodes `docs` with `tok` into shards under `out`; writes and returns the index.
    The tokenizer's file must already be in `out` (its name is recorded)."""
    dtype = np.dtype("<u2" if tok.vocab_size <= 1 << 16 else "<u4")
    shards: list[dict] = []

    def emit(data: np.ndarray) -> None:
        chunk = data.astype(dtype).tobytes()
        name = f"shard-{len(shards):05d}.bin"
        with open(os.path.join(out, name), "wb") as f:
            f.write(chunk)
        shards.append({"file": name, "tokens": len(data),
                       "sha256": hashlib.sha256(chunk).hexdigest()})

    eos = np.asarray([] if tok.eos is None else [tok.eos], np.uint32)
    pending: list[np.ndarray] = []
    count = n_docs = 0
    for doc in docs:
        pending += [tok.encode(doc), eos]
        count, n_docs = count + len(pending[-2]) + len(eos), n_docs + 1
        while count >= shard_tokens:
            data = np.concatenate(pending)
            emit(data[:shard_tokens])
            pending, count = [data[shard_tokens:]], len(data) - shard_tokens
    if count:
        emit(np.concatenate(pending))
    index = {"format": FORMAT, "version": VERSION, "dtype": dtype.name,
             "vocab_size": int(tok.vocab_size), "eos": tok.eos,
             "tokenizer": {"kind": tok.kind, "fingerprint": tok.fingerprint,
                           "file": None if tok.file is None else os.path.basename(tok.file)},
             "num_tokens": sum(s["tokens"] for s in shards), "num_documents": n_docs,
             "shards": shards}
    index["fingerprint"] = fingerprint(index)
    with open(os.path.join(out, INDEX), "w") as f:
        json.dump(index, f, indent=1)
    return index


def fingerprint(index: dict) -> str:
    """SHA-256 over what makes the tokens: the tokenizer, the dtype, every shard."""
    what = {k: index[k] for k in ("dtype", "vocab_size", "eos", "tokenizer", "shards")}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def tokenizer_name(path: str) -> str | None:
    """data.tokenizer's value for the shards in `path`: "byte" or "FILE (sha256 ...)";
    None when the index cannot be read (opening the shards then says why)."""
    try:
        with open(os.path.join(path, INDEX)) as f:
            tok = json.load(f)["tokenizer"]
        return tok["kind"] if tok["file"] is None else \
            f"{tok['file']} (sha256 {tok['fingerprint']})"
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_index(path: str) -> dict:
    """DIR's index.json, checked against the files beside it (one DataError naming the
    first file that differs)."""
    where = os.path.join(path, INDEX)
    try:
        with open(where) as f:
            index = json.load(f)
        ok = index.get("format") == FORMAT and isinstance(index.get("shards"), list)
    except FileNotFoundError:
        raise DataError("data.path", f"{path}: no {INDEX} (write one with jtrain "
                        "tokenize --out=DIR)") from None
    except (OSError, ValueError, AttributeError) as e:
        raise DataError(where, f"not a token index: {e}") from None
    if not ok or index.get("version") != VERSION:
        raise DataError(where, f"not a {FORMAT} index of version {VERSION}")
    if fingerprint(index) != index.get("fingerprint"):
        raise DataError(where, "its fingerprint does not match its entries (the index "
                        "was edited; tokenize again)")
    tok = index["tokenizer"]
    if tok["file"] is not None:
        tok_path = os.path.join(path, tok["file"])
        if not os.path.isfile(tok_path) or tokenizer_lib.file_sha256(tok_path) \
                != tok["fingerprint"]:
            raise DataError(tok_path, "missing, or not the tokenizer the index names "
                            f"(sha256 {tok['fingerprint'][:12]}...)")
    itemsize = np.dtype(index["dtype"]).itemsize
    for shard in index["shards"]:
        shard_path = os.path.join(path, shard["file"])
        if not os.path.isfile(shard_path):
            raise DataError(shard_path, "missing (listed in index.json)")
        if os.path.getsize(shard_path) != shard["tokens"] * itemsize:
            raise DataError(shard_path, f"{os.path.getsize(shard_path)} bytes, index.json "
                            f"says {shard['tokens']} tokens of {itemsize} bytes")
        if tokenizer_lib.file_sha256(shard_path) != shard["sha256"]:
            raise DataError(shard_path, "its sha256 differs from index.json's (the shard "
                            "changed after jtrain tokenize)")
    return index


class TokenWindows:
    """Map-style source of non-overlapping windows of seq_len + 1 tokens inside each
    shard: inputs = w[:-1], targets = w[1:]. `starts` are positions in the shards laid
    end to end; the memory maps open on first use (a grain worker opens its own)."""

    def __init__(self, files, dtype, bases, starts, seq_len: int, name: str):
        self._files, self._dtype, self._bases = list(files), dtype, np.asarray(bases)
        self._starts, self._seq_len, self._name = starts, seq_len, name
        self._maps: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, index):
        if self._maps is None:
            self._maps = [np.memmap(f, dtype=self._dtype, mode="r") for f in self._files]
        g = int(self._starts[index])
        shard = int(np.searchsorted(self._bases, g, side="right")) - 1
        s = g - int(self._bases[shard])
        window = np.asarray(self._maps[shard][s:s + self._seq_len + 1], np.int32)
        return {"inputs": window[:-1], "targets": window[1:]}

    def __getstate__(self):  # a worker maps the files itself
        return {**vars(self), "_maps": None}

    def __repr__(self) -> str:  # deterministic: grain compares it on restore
        return f"TokenWindows({self._name}, n={len(self)}, seq_len={self._seq_len})"


def make_tokens(seq_len: int, val_fraction: float, path: str):
    """(train source, eval source or None, info) over the shards in `path`; the split
    into train and held-out windows is pystdlib's (text.split_windows)."""
    if not path:
        raise DataError("data.path", "data.name=tokens needs data.path: the folder "
                        "jtrain tokenize --out wrote")
    index = read_index(path)
    tokens = np.asarray([s["tokens"] for s in index["shards"]], np.int64)
    bases = np.concatenate([[0], np.cumsum(tokens)[:-1]]).astype(np.int64)
    starts = np.concatenate([b + np.arange(max(0, (n - 1) // seq_len)) * seq_len
                             for b, n in zip(bases, tokens, strict=True)] or [[]])
    if len(starts) < 2:
        raise DataError("data.path", f"{path}: {index['num_tokens']} tokens make fewer "
                        f"than 2 windows of data.seq_len + 1 = {seq_len + 1}")
    train_starts, val_starts = text.split_windows(starts.astype(np.int64), val_fraction)
    files = [os.path.join(path, s["file"]) for s in index["shards"]]
    tok = index["tokenizer"]
    info = {"name": "tokens", "fingerprint": index["fingerprint"],
            "num_tokens": int(index["num_tokens"]), "vocab_size": int(index["vocab_size"]),
            "tokenizer": dict(tok), "byte_level": tok["kind"] == tokenizer_lib.BYTE,
            "tokenizer_path": None if tok["file"] is None
            else os.path.abspath(os.path.join(path, tok["file"]))}
    make = lambda s, name: TokenWindows(files, np.dtype(index["dtype"]), bases, s,  # noqa: E731
                                        seq_len, name)
    return (make(train_starts, "train"),
            make(val_starts, "val") if len(val_starts) else None, info)
