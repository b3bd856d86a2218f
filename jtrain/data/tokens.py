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

import errno
import glob
import hashlib
import json
import os
import re
from typing import Iterator

import numpy as np

from jtrain.data import text, tokenizer as tokenizer_lib
from jtrain.data.items import DataError
from jtrain.errors import first_line

INDEX = "index.json"
FORMAT, VERSION = "jtrain.tokens", 1
SHARD_TOKENS = 1 << 26  # 128 MiB of uint16 per shard
CACHE = "token_shards"  # WORKDIR/token_shards/<fingerprint>/: shards fetched from a bucket
MAX_INDEX = 64 << 20  # bytes of index.json read at most
_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://([^/]*)(/.*)?$")
_KINDS = {int: "a non-negative integer", str: "a string", list: "a list", dict: "an object"}
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # a shard's or tokenizer's file name


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
    if not path.endswith(".jsonl"):
        yield _utf8(path)
        return
    for where, record in jsonl_records(path):
        value = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(value, str):
            raise DataError(where, f"no string field {text_field!r} (--text_field)")
        yield value


def _utf8(path: str) -> str:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(path, f"not UTF-8 text (byte {e.start})") from None


def jsonl_records(path: str) -> Iterator[tuple[str, object]]:
    """("FILE:LINE", the parsed JSON) of each non-blank line; a line that is not JSON is
    one DataError naming FILE:LINE."""
    if not os.path.isfile(path):
        raise DataError(path, "no such file")
    for number, line in enumerate(_utf8(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{number}", json.loads(line)
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
        tok = checked_index(path, _index_bytes(path))["tokenizer"]
    except (DataError, OSError):
        return None
    return tok["kind"] if tok["file"] is None else f"{tok['file']} (sha256 {tok['fingerprint']})"


def is_remote(path: str) -> bool:
    return _URI.match(path or "") is not None


def remote_fs(uri: str, key: str = "data.path"):
    """fsspec's filesystem for an s3:// or gs:// `uri` (credentials from the environment)."""
    m = _URI.match(uri)
    if m.group(1) not in ("s3", "gs") or "@" in m.group(2):
        raise DataError(key, f"{m.group(1)}://{m.group(2).rpartition('@')[2]}...: "
                        "shards are read from s3:// or gs:// with credentials from the "
                        "environment (none in the URI), or from a local folder")
    try:
        import fsspec

        return fsspec.filesystem("s3" if m.group(1) == "s3" else "gcs",
                                 skip_instance_cache=True)
    except ImportError as e:
        raise DataError(key, f"{uri}: it needs {e.name} "
                        "(pip install 'jtrain[s3]' or gcsfs)") from None


def _index_bytes(path: str) -> bytes:
    where = f"{path.rstrip('/')}/{INDEX}"
    try:
        if not is_remote(path):
            with open(os.path.join(path, INDEX), "rb") as f:
                return f.read(MAX_INDEX + 1)
        return remote_fs(path).cat_file(where, start=0, end=MAX_INDEX + 1)
    except FileNotFoundError:
        raise DataError("data.path", f"{path}: no {INDEX} (write one with jtrain "
                        "tokenize --out=DIR)") from None
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - a store client's own errors: one line
        raise _unreadable(where, e) from None


def _unreadable(where: str, e: Exception) -> DataError:
    return DataError(where, f"cannot be read: {type(e).__name__} {first_line(e)}")


def _typed(value, kind, where: str, what: str):
    if not isinstance(value, kind) or isinstance(value, bool) or \
            (isinstance(value, int) and value < 0):
        raise DataError(where, f"{what}: {value!r} is not {_KINDS[kind]}")
    return value


def checked_index(path: str, raw: bytes) -> dict:
    """index.json's content, each field's type checked and each file name a plain name
    inside the folder; one DataError naming index.json and the field otherwise."""
    where = f"{path.rstrip('/')}/{INDEX}"
    if len(raw) > MAX_INDEX:
        raise DataError(where, f"over {MAX_INDEX} bytes; not a token index")
    try:
        index = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(where, f"not a token index (cut short or not JSON: {e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT \
            or index.get("version") != VERSION:
        raise DataError(where, f"not a {FORMAT} index of version {VERSION}")
    if index.get("dtype") not in ("uint16", "uint32"):
        raise DataError(where, f"dtype: {index.get('dtype')!r} is not uint16 or uint32")
    _typed(index.get("vocab_size"), int, where, "vocab_size")
    _typed(index.get("num_tokens"), int, where, "num_tokens")
    if index.get("eos") is not None:
        _typed(index["eos"], int, where, "eos")
    tok = _typed(index.get("tokenizer"), dict, where, "tokenizer")
    _typed(tok.get("kind"), str, where, "tokenizer.kind")
    _typed(tok.get("fingerprint"), str, where, "tokenizer.fingerprint")
    names = [("tokenizer.file", tok.get("file"))] if tok.get("file") is not None else []
    for i, shard in enumerate(_typed(index.get("shards"), list, where, "shards")):
        _typed(shard, dict, where, f"shards[{i}]")
        _typed(shard.get("tokens"), int, where, f"shards[{i}].tokens")
        _typed(shard.get("sha256"), str, where, f"shards[{i}].sha256")
        names.append((f"shards[{i}].file", shard.get("file")))
    for field, name in names:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise DataError(where, f"{field}: {name!r} is not a file name inside the "
                            "folder (refused: a path out of it, or not a name)")
    if fingerprint(index) != index.get("fingerprint"):
        raise DataError(where, "its fingerprint does not match its entries (the index "
                        "was edited; tokenize again)")
    return index


def read_index(path: str, cache: str | None = None) -> tuple[dict, str]:
    """(DIR's index.json, the local folder holding its files), checked against the files
    (one DataError naming the first file that differs). A local DIR's files are hashed
    here, every start; shards on s3:// or gs:// are fetched once into
    `cache`/token_shards/<fingerprint>/ (a run's workdir), hashed as they arrive and
    renamed into place only when they match, so a later start checks their sizes."""
    index = checked_index(path, _index_bytes(path))
    itemsize = np.dtype(index["dtype"]).itemsize
    tok = index["tokenizer"]
    files = ([(tok["file"], None, tok["fingerprint"])] if tok["file"] is not None else []) \
        + [(s["file"], s["tokens"] * itemsize, s["sha256"]) for s in index["shards"]]
    local = path if not is_remote(path) else _fetch(path, index["fingerprint"], files, cache)
    for name, size, sha in files:
        file = os.path.join(local, name)
        if not os.path.isfile(file):
            raise DataError(file, f"missing (listed in {INDEX})")
        if size is not None and os.path.getsize(file) != size:
            raise DataError(file, f"{os.path.getsize(file)} bytes, {INDEX} says "
                            f"{size // itemsize} tokens of {itemsize} bytes")
        if local == path and tokenizer_lib.file_sha256(file) != sha:
            raise DataError(file, _changed(size))
    return index, local


def _changed(size) -> str:
    return ("missing, or not the tokenizer the index names" if size is None else
            "its sha256 differs from index.json's (the shard changed after jtrain tokenize)")


def _fetch(uri: str, fp: str, files, cache: str | None) -> str:
    if cache is None:
        raise DataError("data.path", f"{uri}: shards on an object store are read by a "
                        "run, into its workdir (train with --workdir, or copy them to a "
                        "local folder)")
    folder = os.path.join(cache, CACHE, fp)
    os.makedirs(folder, exist_ok=True)
    fs = remote_fs(uri)
    for name, size, sha in files:
        dest = os.path.join(folder, name)
        if os.path.isfile(dest) and not os.path.islink(dest) and \
                (size is None or os.path.getsize(dest) == size):
            continue  # renamed into place only after its hash matched
        remote = f"{uri.rstrip('/')}/{name}"
        digest, tmp = hashlib.sha256(), f"{dest}.{os.getpid()}.{os.urandom(4).hex()}.part"
        try:
            with fs.open(remote, "rb") as src, open(tmp, "wb") as out:
                for block in iter(lambda: src.read(1 << 22), b""):
                    digest.update(block)
                    out.write(block)
            got = os.path.getsize(tmp)
            if (size is not None and got != size) or digest.hexdigest() != sha:
                raise DataError(remote, _changed(None) if size is None else
                                _changed(size) if got == size else
                                f"{got} bytes, {INDEX} says {size} bytes")
            os.replace(tmp, dest)
        except FileNotFoundError:
            raise DataError(remote, f"missing (listed in {INDEX})") from None
        except Exception as e:
            if isinstance(e, DataError) or getattr(e, "errno", None) == errno.ENOSPC:
                raise  # ours, or a full disk (the disk error's exit code)
            raise _unreadable(remote, e) from None  # a store client's own errors
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return folder


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


def make_tokens(seq_len: int, val_fraction: float, path: str, cache: str | None = None):
    """(train source, eval source or None, info) over the shards in `path` (a folder, or
    s3:// / gs:// fetched into `cache`); the split into train and held-out windows is
    pystdlib's (text.split_windows)."""
    if not path:
        raise DataError("data.path", "data.name=tokens needs data.path: the folder "
                        "jtrain tokenize --out wrote")
    index, local = read_index(path, cache)
    tokens = np.asarray([s["tokens"] for s in index["shards"]], np.int64)
    bases = np.concatenate([[0], np.cumsum(tokens)[:-1]]).astype(np.int64)
    starts = np.concatenate([b + np.arange(max(0, (n - 1) // seq_len)) * seq_len
                             for b, n in zip(bases, tokens, strict=True)] or [[]])
    if len(starts) < 2:
        raise DataError("data.path", f"{path}: {index['num_tokens']} tokens make fewer "
                        f"than 2 windows of data.seq_len + 1 = {seq_len + 1}")
    train_starts, val_starts = text.split_windows(starts.astype(np.int64), val_fraction)
    files = [os.path.join(local, s["file"]) for s in index["shards"]]
    tok = index["tokenizer"]
    info = {"name": "tokens", "fingerprint": index["fingerprint"],
            "num_tokens": int(index["num_tokens"]), "vocab_size": int(index["vocab_size"]),
            "tokenizer": dict(tok), "byte_level": tok["kind"] == tokenizer_lib.BYTE,
            "tokenizer_path": None if tok["file"] is None
            else os.path.abspath(os.path.join(local, tok["file"]))}
    make = lambda s, name: TokenWindows(files, np.dtype(index["dtype"]), bases, s,  # noqa: E731
                                        seq_len, name)
    return (make(train_starts, "train"),
            make(val_starts, "val") if len(val_starts) else None, info)
