"""Files jtrain did not write, crafted to break its readers: each is one line naming the
file and the field, with its documented exit code (2 or 3), never an internal error.

ROWS: (id, what the files are, the reader call, the text the one line holds, the exit
code). The readers run in-process (the line is `errors.render(e)`, as every command
prints it); SUBPROCESS_ROWS run two of them as a person does, `python -m jtrain ...`.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib

import pytest

from jtrain import errors
from jtrain.checkpoint import export, hf, integrity, policy
from jtrain.engine.checkpoint_eval import resolve_step
from jtrain.observe import hashes, jsonl
from journey import user_env

F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


def st(header, data: bytes = b"\0" * 8, *, length: int | None = None) -> bytes:
    """A safetensors file: header (a dict, or raw bytes), data; `length` overrides N."""
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(head) if length is None else length) + head + data


def write(root, files: dict) -> str:
    """Writes {relative path: bytes | str | ("fifo",) | ("link", target)} under root."""
    for rel, content in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if content == ("fifo",):
            os.mkfifo(path)
        elif isinstance(content, tuple):
            os.symlink(content[1], path)
        else:
            with open(path, "wb") as f:
                f.write(content if isinstance(content, bytes) else content.encode())
    return str(root)


def manifest(files, step: int = 1, **extra) -> str:
    body = {"format": integrity.FORMAT, "step": step, "files": files, "json_files": [],
            "tree": {}, "time": 0.0, **extra}
    if files is None:
        del body["files"]
    return json.dumps({**body, "crc": zlib.crc32(integrity._canonical(body))})


def read_st(root):
    return export.read_safetensors(os.path.join(root, "x.safetensors"))


def st_row(name, content, text):
    return (name, {"x.safetensors": content}, read_st, text, 3)


GOOD = st({"w": F32})
HF_CONFIG = json.dumps({"model_type": "llama", "hidden_act": "silu"})
TARGET = {"embed/embedding": (256, 8), "layer_0/attn/query": (8, 2, 4),
          "layer_0/mlp/wi": (8, 16), "layer_0/mlp/wi_gate": (8, 16)}


def hf_index(weight_map) -> str:
    return json.dumps({"metadata": {}, "weight_map": weight_map})


def hf_dir(root):
    return hf.read_dir(str(root))


def check_hf_config(config):
    return lambda root: hf.check_config(config, "hf:DIR", TARGET)


def step_dir_check(root):
    return export.find_step_dir(os.path.join(root, "checkpoints", "1"))


def hashes_read(root):
    return hashes.read(root)


def hash_line(**record) -> str:
    return json.dumps({"step": 1, "hash": "ab" * 32, "parts": {"params": "cd"},
                       "examples": [1], **record}) + "\n"


ROWS = [
    # the safetensors reader
    st_row("empty", b"", "shorter than the 8-byte header length"),
    st_row("header-cap", st(b"{}", length=1 << 62), "over the 100000000-byte cap"),
    st_row("header-past-end", st(b"{}", length=64), "runs past the end of the file"),
    st_row("not-utf8", st(b'{"\xff": 1}'), "header: not UTF-8"),
    st_row("not-json", st(b"{nope"), "header: not JSON"),
    st_row("nan", st(b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8],'
                     b' "x": NaN}}'), "header: not JSON"),
    st_row("not-object", st([1, 2]), "header: expected a JSON object"),
    st_row("duplicate", st(b'{"w": %s, "w": %s}' % ((json.dumps(F32).encode(),) * 2)),
           "header: key 'w' appears twice"),
    st_row("deep", st(b"[" * 200_000 + b"]" * 200_000), "header: nested too deeply"),
    st_row("spec-not-object", st({"w": [1]}), "tensor 'w': expected an object"),
    st_row("no-dtype", st({"w": {"shape": [2], "data_offsets": [0, 8]}}),
           "tensor 'w': dtype: missing"),
    st_row("dtype-unknown", st({"w": {**F32, "dtype": "F8_E4M3"}}),
           "tensor 'w': dtype: 'F8_E4M3' is not one of"),
    st_row("dtype-not-str", st({"w": {**F32, "dtype": 4}}), "tensor 'w': dtype: 4"),
    st_row("shape-negative", st({"w": {**F32, "shape": [-2]}}), "tensor 'w': shape: expected"),
    st_row("shape-float", st({"w": {**F32, "shape": [2.0]}}), "tensor 'w': shape: expected"),
    st_row("shape-bool", st({"w": {**F32, "shape": [True, True]}}), "tensor 'w': shape"),
    st_row("shape-str", st({"w": {**F32, "shape": "2"}}), "tensor 'w': shape"),
    st_row("shape-huge", st({"w": {**F32, "shape": [1 << 64]}}), "tensor 'w': shape"),
    st_row("shape-overflow", st({"w": {**F32, "shape": [1 << 40, 1 << 40, 0]}}),
           "has too many elements"),
    st_row("offsets-triple", st({"w": {**F32, "data_offsets": [0, 4, 8]}}),
           "tensor 'w': data_offsets: expected a pair"),
    st_row("offsets-negative", st({"w": {**F32, "data_offsets": [-8, 0]}}),
           "tensor 'w': data_offsets: expected a pair"),
    st_row("offsets-reversed", st({"w": {**F32, "data_offsets": [8, 0]}}),
           "begin 8 is after end 0"),
    st_row("size-mismatch", st({"w": {**F32, "shape": [3]}}),
           "0..8 is 8 bytes, shape [3] of F32 needs 12"),
    st_row("overlap", st({"w": F32, "v": {**F32, "data_offsets": [4, 12]}}, b"\0" * 12),
           "overlapping the tensor before it"),
    st_row("gap", st({"w": {**F32, "data_offsets": [4, 12]}}, b"\0" * 12),
           "leaving a gap after byte 0"),
    st_row("trailing", st({"w": F32}, b"\0" * 12), "4 bytes after the last tensor"),
    st_row("truncated", st({"w": F32}, b"\0" * 5), "file truncated?"),
    st_row("metadata-not-str", st({"__metadata__": {"a": 1}, "w": F32}),
           "__metadata__: expected an object of strings"),
    st_row("fifo", ("fifo",), "not a regular file"),
    st_row("dev-zero", ("link", "/dev/zero"), "not a regular file"),
    # a Hugging Face directory
    ("hf-config-not-json", {"config.json": "{", "model.safetensors": GOOD}, hf_dir,
     "config.json: not JSON", 3),
    ("hf-config-list", {"config.json": "[]", "model.safetensors": GOOD}, hf_dir,
     "config.json: expected a JSON object", 3),
    ("hf-config-fifo", {"config.json": ("fifo",)}, hf_dir, "config.json: not a regular", 3),
    ("hf-no-weight-map", {"config.json": HF_CONFIG,
                          "model.safetensors.index.json": '{"metadata": {}}'}, hf_dir,
     "model.safetensors.index.json: weight_map: missing", 3),
    ("hf-weight-map-list", {"config.json": HF_CONFIG,
                            "model.safetensors.index.json": '{"weight_map": ["a"]}'}, hf_dir,
     "weight_map: missing or not an object", 3),
    ("hf-shard-dotdot", {"config.json": HF_CONFIG, "model.safetensors.index.json":
                         hf_index({"w": "../x.safetensors"})}, hf_dir,
     "'w' -> '../x.safetensors': a shard is a plain file name", 3),
    ("hf-shard-absolute", {"config.json": HF_CONFIG, "model.safetensors.index.json":
                           hf_index({"w": "/etc/passwd"})}, hf_dir,
     "a shard is a plain file name", 3),
    ("hf-shard-subdir", {"config.json": HF_CONFIG, "model.safetensors.index.json":
                         hf_index({"w": "sub/a.safetensors"}), "sub/a.safetensors": GOOD},
     hf_dir, "a shard is a plain file name", 3),
    ("hf-shard-not-str", {"config.json": HF_CONFIG, "model.safetensors.index.json":
                          hf_index({"w": 3})}, hf_dir, "a shard is a plain file name", 3),
    ("hf-shard-fifo", {"config.json": HF_CONFIG, "model.safetensors.index.json":
                       hf_index({"w": "a.safetensors"}), "a.safetensors": ("fifo",)},
     hf_dir, "a.safetensors: not a regular file", 3),
    ("hf-shard-dev-zero", {"config.json": HF_CONFIG, "model.safetensors.index.json":
                           hf_index({"w": "a.safetensors"}),
                           "a.safetensors": ("link", "/dev/zero")},
     hf_dir, "a.safetensors: not a regular file", 3),
    ("hf-single-dev-zero", {"config.json": HF_CONFIG,
                            "model.safetensors": ("link", "/dev/zero")},
     hf_dir, "model.safetensors: not a regular file", 3),
    ("hf-tensor-other-shard", {"config.json": HF_CONFIG, "model.safetensors.index.json":
                               hf_index({"w": "a.safetensors", "v": "a.safetensors"}),
                               "a.safetensors": GOOD, "b.safetensors": st({"v": F32})},
     hf_dir, "'v' -> 'a.safetensors': that shard has no such tensor", 3),
    ("hf-hidden-size-str", {}, check_hf_config({"model_type": "llama",
                                                "hidden_size": "8"}),
     "config.json hidden_size='8': expected an integer", 3),
    ("hf-heads-bool", {}, check_hf_config({"model_type": "llama",
                                           "num_attention_heads": True}),
     "num_attention_heads=True: expected an integer", 3),
    ("hf-model-type-list", {}, check_hf_config({"model_type": ["llama"]}),
     "model_type=['llama']: expected a string", 3),
    ("hf-eps-str", {}, check_hf_config({"model_type": "llama", "hidden_act": "silu",
                                        "rms_norm_eps": "tiny"}),
     "rms_norm_eps='tiny': expected a number", 3),
    ("hf-rope-list", {}, check_hf_config({"model_type": "llama", "hidden_act": "silu",
                                          "rope_parameters": [1]}),
     "rope_parameters=[1]: expected an object", 3),
    ("hf-rope-theta-str", {}, check_hf_config({"model_type": "llama", "hidden_act": "silu",
                                               "rope_parameters": {"rope_theta": "x"}}),
     "rope_theta: expected a number", 3),
    # a checkpoint's manifest
    ("manifest-no-files", {"checkpoints/1/jtrain_manifest.json": manifest(None)},
     step_dir_check, "files: missing or not an object", 3),
    ("manifest-not-pair", {"checkpoints/1/jtrain_manifest.json": manifest({"a": [1]})},
     step_dir_check, "files: 'a': expected [size, crc]", 3),
    ("manifest-dotdot", {"checkpoints/1/jtrain_manifest.json":
                         manifest({"../../outside": [0, 0]}), "outside": ""},
     step_dir_check, "../../outside: not a plain path inside the step directory", 3),
    ("manifest-absolute", {"checkpoints/1/jtrain_manifest.json":
                           manifest({"/etc/passwd": [0, 0]})},
     step_dir_check, "/etc/passwd: not a relative path", 3),
    ("manifest-json-files-dotdot", {"checkpoints/1/jtrain_manifest.json":
                                    manifest({}, json_files=["../../config.json"])},
     step_dir_check, "../../config.json: not a plain path", 3),
    ("manifest-linked-folder", {"checkpoints/1/jtrain_manifest.json":
                                manifest({"state/x": [0, 0]}), "checkpoints/1/state":
                                ("link", "/etc"), },
     step_dir_check, "state/x: its folder is not a directory", 3),
    ("manifest-tree", {"checkpoints/1/jtrain_manifest.json": manifest({}, tree=[1])},
     step_dir_check, "tree: expected an object", 3),
    # step names
    ("step-superscript", {"checkpoints/²/x": ""},
     lambda root: export.find_step_dir(root, "²"), "step: expected a step number", 3),
    ("step-dir-superscript", {"checkpoints/²/jtrain_manifest.json": manifest({})},
     lambda root: export.find_step_dir(os.path.join(root, "checkpoints", "²")),
     "a checkpoint whose folder name is not a step number", 3),
    ("step-dir-scan", {"checkpoints/²/x": "", "checkpoints/٣/x": ""},
     lambda root: export.find_step_dir(root), "no checkpoints", 3),
    # hashes.jsonl (jtrain diff, jtrain replay)
    ("hashes-step-str", {"hashes.jsonl": hash_line(step="1")}, hashes_read,
     "hashes.jsonl: line 1: step: expected a non-negative integer, got '1'", 2),
    ("hashes-step-missing", {"hashes.jsonl": hash_line() + '{"hash": "ab"}\n'}, hashes_read,
     "hashes.jsonl: line 2: step: expected a non-negative integer, got None", 2),
    ("hashes-step-float", {"hashes.jsonl": hash_line(step=1.5)}, hashes_read,
     "line 1: step: expected a non-negative integer, got 1.5", 2),
    ("hashes-step-bool", {"hashes.jsonl": hash_line(step=True)}, hashes_read,
     "line 1: step: expected a non-negative integer, got True", 2),
    ("hashes-not-utf8", {"hashes.jsonl": b'{"step": 1, "hash": "\xff"}\n'}, hashes_read,
     "line 1: not UTF-8", 2),
    ("hashes-parts-list", {"hashes.jsonl": hash_line(parts=[])}, hashes_read,
     "line 1: parts: expected an object", 2),
    ("hashes-hash-missing", {"hashes.jsonl": '{"step": 1}\n'}, hashes_read,
     "line 1: hash: expected a string", 2),
    ("hashes-torn-middle", {"hashes.jsonl": '{"step": 1, "ha\n' + hash_line()}, hashes_read,
     "line 1: not JSON", 2),
    ("hashes-fifo", {"hashes.jsonl": ("fifo",)}, hashes_read,
     "hashes.jsonl: not a regular file", 2),
]


@pytest.mark.parametrize("name, files, call, text, code", ROWS, ids=[r[0] for r in ROWS])
def test_crafted_file_is_one_line(tmp_path, name, files, call, text, code):
    root = write(tmp_path, files)
    with pytest.raises(errors.JtrainError) as raised:
        call(root)
    line = errors.render(raised.value)
    assert text in line, line
    assert "\n" not in line and "internal" not in line
    assert errors.exit_code(raised.value) == code, line


def test_good_files_read(tmp_path):
    """The table's good pieces read: a torn last line is skipped, the rest kept."""
    root = write(tmp_path, {"x.safetensors": GOOD,
                            "hashes.jsonl": hash_line() + '{"step": 2, "ha'})
    tensors, meta = read_st(root)
    assert meta == {} and tensors["w"].tolist() == [0.0, 0.0]
    assert [r["step"] for r in hashes.read(root)] == [1]


def test_metrics_jsonl_bad_lines_are_skipped(tmp_path):
    """metrics.jsonl's lenient readers (best_logged_step, summaries) skip bad lines."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'[1]\n{"step": "x", "eval/loss": 0.1}\n\xff\xfe\n{"step": 2, '
                     b'"eval/loss": 0.5}\n' + b"[" * 5000 + b"\n" + b'{"step": 4, "eval/lo')
    assert [r["step"] for r in jsonl.read_records(str(path))] == [2]
    assert policy.best_logged_step(str(tmp_path), [2, 4], "eval/loss", "min") == 2
    jsonl.truncate_after(str(path), 3)  # a resume: the valid lines up to step 3 stay
    assert path.read_bytes() == b'{"step": 2, "eval/loss": 0.5}\n'


@pytest.mark.parametrize("step", ["²", "٣", " 3", "+3", "3_0", "3.0"])
def test_step_flag_is_ascii_digits(step):
    assert integrity.parse_step(step) is None
    with pytest.raises(ValueError, match="expected a step number"):
        resolve_step(step, [3, 30], "WORKDIR", monitor=None, mode="min")
    assert resolve_step("30", [3, 30], "WORKDIR", monitor=None, mode="min") == 30


def _run(cwd, *args):
    return subprocess.run([sys.executable, "-m", "jtrain", *args], cwd=cwd, env=user_env(),
                          capture_output=True, text=True, timeout=120)


def test_commands_print_one_line(tmp_path):
    """As a person meets them: `jtrain diff` on a run whose hashes.jsonl has `parts: []`
    (exit 2) and `jtrain export` of a step whose manifest points outside (exit 3)."""
    for run in ("a", "b"):
        write(tmp_path / run, {"config.json": "{}", "hashes.jsonl": hash_line(parts=[])})
    got = _run(tmp_path, "diff", "a", "b")
    assert got.returncode == 2, got.stderr
    assert got.stderr.strip().splitlines() == [
        f"jtrain: workdir error: {tmp_path / 'a' / 'hashes.jsonl'}: line 1: parts: expected "
        "an object of part name -> hash"]
    write(tmp_path / "c", {"checkpoints/1/jtrain_manifest.json":
                           manifest({"../../../outside": [0, 0]})})
    got = _run(tmp_path, "export", "--workdir=c", "--out=out")
    assert got.returncode == 3, got.stderr
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and "not a plain path inside the step directory" in lines[0], lines
    assert "Traceback" not in got.stderr and not (tmp_path / "out").exists()
