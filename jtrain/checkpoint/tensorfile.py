"""The safetensors format, written and read back with every field checked.

A file is an 8-byte little-endian header length N, N bytes of a UTF-8 JSON object, then
the data section. The header maps each tensor name to {"dtype", "shape", "data_offsets"}
(offsets relative to the data section) and may hold "__metadata__", an object of strings.

`read_safetensors` opens a file jtrain may not have written (an export, a Hugging Face
shard), so it trusts nothing: the file is a regular file (not a FIFO or a device behind a
symlink), the header is at most MAX_HEADER bytes of JSON without duplicate keys, each
dtype is known, each shape a list of non-negative integers, each data_offsets a pair of
integers with begin <= end, each tensor's byte size is prod(shape) * itemsize (Python
integers: no overflow), and the tensors cover the data section exactly (no overlap, no
gap, nothing after them). It reads only the bytes the header accounts for. Anything else
is one ExportError naming the file and the field (exit 3).
"""

from __future__ import annotations

import json
import os
import stat
import struct

import numpy as np

from jtrain.errors import ExportError, first_line

# The header cap of the safetensors library itself.
MAX_HEADER = 100_000_000
_U64 = 1 << 64

_TO_ST = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
          "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint64": "U64",
          "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
          "complex64": "C64"}
_FROM_ST = {v: k for k, v in _TO_ST.items()}


def np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def write_safetensors(path: str, tensors: dict[str, np.ndarray],
                      metadata: dict[str, str] | None = None) -> None:
    header: dict = {"__metadata__": dict(metadata or {})}
    offset = 0
    arrays = {}
    for name in sorted(tensors):
        arr = np.asarray(tensors[name], order="C")  # ascontiguousarray makes 0-d 1-d
        if arr.dtype.name not in _TO_ST:
            raise ExportError(f"{name}: dtype {arr.dtype.name} has no safetensors code")
        arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
        header[name] = {"dtype": _TO_ST[arr.dtype.name], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        arrays[name] = arr
        offset += arr.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    tmp = path + ".tmp"
    if os.path.lexists(tmp):  # a killed write's, or a planted link: removed, not followed
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    with os.fdopen(fd, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for name in sorted(arrays):
            f.write(arrays[name].tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def open_regular(path: str, error=ExportError):
    """`path` opened for binary reading if it is a regular file (a symlink to one is
    fine); a FIFO, a device or a directory is one `error` naming the path. Never blocks
    on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise error(path, f"cannot read ({e.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise error(path, "not a regular file (a FIFO, a device or a directory)")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_safetensors(path: str) -> tuple[dict[str, np.ndarray], dict]:
    """(tensors, metadata). Checks every field (module docstring); raises ExportError
    naming the file."""
    def bad(why: str):
        raise ExportError(path, why)

    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            bad(f"not a safetensors file ({size} bytes, shorter than the 8-byte header "
                "length)")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER:
            bad(f"header length {n} bytes is over the {MAX_HEADER}-byte cap")
        if n > size - 8:
            bad(f"header length {n} bytes runs past the end of the file ({size} bytes; "
                "truncated?)")
        raw = f.read(n)
        header = _parse_header(raw, bad)
        metadata, entries, end = _layout(header, bad)
        data_size = size - 8 - n
        if end > data_size:
            bad(f"the tensors need {end} data bytes, the file has {data_size} (file "
                "truncated?)")
        if end < data_size:
            bad(f"{data_size - end} bytes after the last tensor (the tensors must cover the "
                "data section)")
        body = memoryview(f.read(end))
    if len(body) != end:
        bad("the file changed while it was read")
    out = {name: np.frombuffer(body[begin:stop], dtype=dtype).reshape(shape)
           for name, dtype, shape, begin, stop in entries}
    return out, metadata


class _Duplicate(ValueError):
    pass


def _pairs(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        raise _Duplicate(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return out


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _parse_header(raw: bytes, bad) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        bad(f"header: not UTF-8 (byte {e.start})")
    try:
        header = json.loads(text, object_pairs_hook=_pairs, parse_constant=_no_constant)
    except RecursionError:
        bad("header: nested too deeply")
    except _Duplicate as e:
        bad(f"header: key {_short(e.args[0])} appears twice")
    except ValueError as e:
        bad(f"header: not JSON ({first_line(e)[:100]})")
    if not isinstance(header, dict):
        bad("header: expected a JSON object of tensors")
    return header


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _text(value) -> bool:
    """A JSON string that is valid Unicode (no lone surrogate)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _index(value) -> bool:
    return type(value) is int and 0 <= value < _U64


def _layout(header: dict, bad) -> tuple[dict, list, int]:
    """(metadata, [(name, dtype, shape, begin, end)] by offset, end of the last)."""
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(
            _text(k) and _text(v) for k, v in metadata.items()):
        bad("__metadata__: expected an object of strings")
    entries = []
    for name, spec in header.items():
        where = f"tensor {_short(name)}"
        if not _text(name):
            bad(f"{where}: the name is not valid Unicode")
        if not isinstance(spec, dict):
            bad(f"{where}: expected an object with dtype, shape and data_offsets, got "
                f"{_short(spec)}")
        for field in ("dtype", "shape", "data_offsets"):
            if field not in spec:
                bad(f"{where}: {field}: missing")
        code, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
        if not isinstance(code, str) or code not in _FROM_ST:
            bad(f"{where}: dtype: {_short(code)} is not one of {', '.join(_FROM_ST)}")
        if not isinstance(shape, list) or not all(_index(d) for d in shape):
            bad(f"{where}: shape: expected a list of non-negative integers, got "
                f"{_short(shape)}")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(_index(o) for o in offsets)):
            bad(f"{where}: data_offsets: expected a pair of non-negative integers, got "
                f"{_short(offsets)}")
        begin, end = offsets
        if begin > end:
            bad(f"{where}: data_offsets: begin {begin} is after end {end}")
        dtype = np_dtype(_FROM_ST[code]).newbyteorder("<")
        count = 1
        for d in shape:  # in order, as the safetensors library counts
            count *= d
            if count >= _U64:
                bad(f"{where}: shape: {_short(shape)} has too many elements")
        if count * dtype.itemsize * 8 >= _U64:  # the library counts bits
            bad(f"{where}: shape: {_short(shape)} is too large")
        if end - begin != count * dtype.itemsize:
            bad(f"{where}: data_offsets: {begin}..{end} is {end - begin} bytes, shape "
                f"{_short(shape)} of {code} needs {count * dtype.itemsize}")
        entries.append((name, dtype, tuple(shape), begin, end))
    entries.sort(key=lambda e: (e[3], e[4]))
    position = 0
    for name, _, _, begin, end in entries:
        if begin != position:
            bad(f"tensor {_short(name)}: data_offsets: begins at {begin}, "
                + (f"overlapping the tensor before it (which ends at {position})"
                   if begin < position else f"leaving a gap after byte {position}"))
        position = end
    return metadata, entries, position
