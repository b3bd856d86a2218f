"""jtrain's safetensors reader against the safetensors package as the oracle, on
generated and mutated files: whatever `safetensors.numpy.load` accepts, jtrain reads to
the same arrays; whatever it rejects, jtrain rejects with its one-line ExportError
(never another exception).

Two documented differences: jtrain reads BF16 (numpy has no bfloat16, so the oracle's
numpy loader raises KeyError on it), and jtrain rejects a header with a duplicate key
(the library keeps the last one).

Beside the generated files, crafted layouts the random ones may miss: two tensors that
share one byte, a gap, a tensor past the end, a byte after the last one, duplicate names.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load as oracle_load
from safetensors.numpy import save as oracle_save

from jtrain import errors
from jtrain.checkpoint import export

DTYPES = ["float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint64",
          "uint32", "uint16", "uint8", "bool", "complex64"]
SETTINGS = settings(max_examples=150, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])


@st.composite
def tensors(draw, min_size: int = 0, min_dim: int = 0) -> dict[str, np.ndarray]:
    names = draw(st.lists(st.text(min_size=1, max_size=8), min_size=min_size, max_size=4,
                          unique=True).filter(lambda ns: "__metadata__" not in ns))
    out = {}
    for name in names:
        dtype = np.dtype(draw(st.sampled_from(DTYPES)))
        shape = tuple(draw(st.lists(st.integers(min_dim, 3), max_size=3)))
        raw = draw(st.binary(min_size=dtype.itemsize * int(np.prod(shape)),
                             max_size=dtype.itemsize * int(np.prod(shape))))
        out[name] = np.frombuffer(raw, dtype=dtype).reshape(shape)
    return out


def _has_duplicate_key(data: bytes) -> bool:
    try:
        (n,) = struct.unpack("<Q", data[:8])
        found = []

        def pairs(items):
            keys = [k for k, _ in items]
            found.append(len(set(keys)) != len(keys))
            return dict(items)

        json.loads(data[8:8 + n].decode("utf-8"), object_pairs_hook=pairs)
        return any(found)
    except Exception:
        return False


def check_against_oracle(tmp_path, data: bytes) -> None:
    path = tmp_path / "f.safetensors"
    path.write_bytes(data)
    try:
        want = oracle_load(data)
    except Exception as e:  # the oracle rejects
        want = e
    try:
        got, _ = export.read_safetensors(str(path))
    except errors.ExportError as e:
        line = errors.render(e)
        assert "\n" not in line and line.startswith("jtrain: export error: "), line
        got = e
    if isinstance(want, Exception):
        bf16 = isinstance(want, KeyError) and "BF16" in str(want)
        assert isinstance(got, Exception) or bf16, (want, data[:200])
        return
    if isinstance(got, Exception):
        assert _has_duplicate_key(data), (got, data[:200])
        return
    assert sorted(got) == sorted(want), data[:200]
    for name, arr in want.items():
        assert got[name].dtype == arr.dtype and got[name].shape == arr.shape, name
        assert got[name].tobytes() == arr.tobytes(), name


@SETTINGS
@given(tensors(), st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2))
def test_generated_files_read_as_the_library_writes_them(tmp_path, arrays, metadata):
    data = oracle_save(arrays, metadata=metadata or None)
    check_against_oracle(tmp_path, data)
    got, meta = export.read_safetensors(str(tmp_path / "f.safetensors"))
    assert meta == (metadata or {})
    path = str(tmp_path / "ours.safetensors")  # jtrain's writer: the library reads it back
    export.write_safetensors(path, arrays, metadata)
    with open(path, "rb") as f:
        back = oracle_load(f.read())
    assert all(back[k].tobytes() == arrays[k].tobytes() and back[k].shape == arrays[k].shape
               for k in arrays)


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2, 1 << 65)
                     | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)


@st.composite
def mutated(draw) -> bytes:
    """A valid file, then one of: bytes flipped, cut or appended; a header field (dtype,
    shape, data_offsets) replaced by any JSON value or a nearby integer; a whole entry
    replaced; a tensor moved; the header length changed."""
    arrays = draw(tensors(min_size=2, min_dim=1))
    data = bytearray(oracle_save(arrays))
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = bytes(data[8 + n:])
    kind = draw(st.sampled_from(["flip", "cut", "append", "field", "int", "shift", "entry",
                                 "length"]))
    if kind == "flip" and data:
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
        return bytes(data)
    if kind == "cut":
        return bytes(data[:draw(st.integers(0, len(data)))])
    if kind == "append":
        return bytes(data) + draw(st.binary(min_size=1, max_size=16))
    if kind == "length":
        n2 = draw(st.integers(0, n + 16) | st.sampled_from([1 << 63, 100_000_001]))
        return struct.pack("<Q", n2) + bytes(data[8:])
    names = [k for k in header if k != "__metadata__"]
    if not names:
        header[draw(st.text(max_size=4))] = draw(_JSON)
    else:
        name = draw(st.sampled_from(names))
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        if kind == "field":
            header[name][field] = draw(_JSON | st.sampled_from(["BF16", "F8_E4M3", "C64"]))
        elif kind == "int" and field != "dtype" and header[name][field]:
            i = draw(st.integers(0, len(header[name][field]) - 1))
            header[name][field][i] += draw(st.integers(-3, 3))
        elif kind == "shift":  # the whole tensor moved: an overlap or a gap
            delta = draw(st.integers(-8, 8))
            header[name]["data_offsets"] = [o + delta for o in header[name]["data_offsets"]]
        else:
            header[name] = draw(_JSON)
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + body


@SETTINGS
@given(mutated())
def test_mutated_files_are_read_or_rejected_as_the_library_does(tmp_path, data):
    check_against_oracle(tmp_path, data)


def _crafted(tensors: dict, body: int, head: bytes | None = None) -> bytes:
    """A file of uint8 tensors {name: (begin, end)} over a `body`-byte data section."""
    head = head or json.dumps({k: {"dtype": "U8", "shape": [e - b], "data_offsets": [b, e]}
                               for k, (b, e) in tensors.items()}).encode()
    return struct.pack("<Q", len(head)) + head + bytes(range(body))


_DUPLICATE = (b'{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},'
              b'"a":{"dtype":"U8","shape":[4],"data_offsets":[3,7]}}')
CRAFTED = {  # name: (file, refused by the library)
    "adjacent": (_crafted({"a": (0, 4), "b": (4, 8)}, 8), False),
    "one shared byte": (_crafted({"a": (0, 4), "b": (3, 7)}, 7), True),
    "one shared byte, a third after": (_crafted({"a": (0, 4), "b": (3, 7), "c": (7, 9)}, 9),
                                       True),
    "one byte inside the one before": (_crafted({"a": (0, 4), "b": (3, 4)}, 4), True),
    "the same bytes twice": (_crafted({"a": (0, 4), "b": (0, 4)}, 4), True),
    "an empty tensor inside another": (_crafted({"a": (0, 4), "e": (2, 2)}, 4), True),
    "an empty tensor at the end": (_crafted({"a": (0, 4), "e": (4, 4)}, 4), False),
    "a gap of one byte": (_crafted({"a": (0, 4), "b": (5, 9)}, 9), True),
    "a gap at the start": (_crafted({"a": (1, 5)}, 5), True),
    "past the end by one byte": (_crafted({"a": (0, 4), "b": (4, 8)}, 7), True),
    "one byte after the last": (_crafted({"a": (0, 4), "b": (4, 8)}, 9), True),
    "duplicate names overlapping": (_crafted({}, 7, _DUPLICATE), True),
    # the library keeps the last of two equal names; jtrain refuses (module docstring)
    "duplicate names, the same bytes": (_crafted({}, 4, _DUPLICATE.replace(b"3,7", b"0,4")),
                                        False),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_layouts_are_refused_exactly_when_the_library_refuses(tmp_path, case):
    data, refused = CRAFTED[case]
    try:
        oracle_load(data)
    except Exception:
        assert refused, case
    else:
        assert not refused, case
    check_against_oracle(tmp_path, data)
