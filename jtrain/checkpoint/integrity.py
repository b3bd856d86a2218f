"""Our own integrity layer under orbax: orbax restores a flipped byte silently and casts
dtypes silently, so a checkpoint is trusted only if it matches what was recorded when it
was written.

The manifest: while orbax finalizes a save (its post-finalization callback, in the
background thread, before the temporary directory is renamed into place) we write
`jtrain_manifest.json` into the step directory: the size and CRC-32 of every file in it
(orbax's own step metadata, rewritten after us, must only parse), the step, and the tree spec
(path -> shape, dtype) of the saved TrainState. The rename makes the manifest part of the
atomic commit, so "has a valid manifest" means "finished".

Checks, newest step first (`check_step`): the step directory is a real directory (not a
file, not a symlink), the manifest parses and its own CRC matches, every listed file
exists as a regular file with the recorded size and CRC. A damaged step is reported in
one line naming the path and, unless restores are strict, moved aside (never deleted:
evidence stays, and nothing is removed through a symlink) into `WORKDIR/checkpoints.damaged/`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import time
import zlib

import jax
import numpy as np

from jtrain.errors import CheckpointError, WorkdirError
from jtrain.observe import runfiles

MANIFEST = "jtrain_manifest.json"
FORMAT = 1
TMP_MARK = ".orbax-checkpoint-tmp"
# orbax rewrites its step metadata (commit timestamp) after our manifest is written:
# checked as parseable JSON only.
REWRITTEN = ("_CHECKPOINT_METADATA",)
_CHUNK = 8 << 20
_STEP_NAME = re.compile(r"[0-9]+")


def file_crc(path: str) -> tuple[int, int]:
    """(size, crc32) of a file, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                return size, crc
            crc = zlib.crc32(block, crc)
            size += len(block)


def tree_spec(tree) -> dict[str, list]:
    """{"params/dense/kernel": [[3, 4], "float32"], ...} for any pytree of arrays."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out[leaf_path(path)] = [list(np.shape(leaf)), np.dtype(leaf.dtype).name]
    return out


def leaf_path(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def write_manifest(step_dir: str, step: int, spec: dict) -> None:
    """Checksum every file under `step_dir` and write the manifest (atomically)."""
    files = {}
    for root, dirs, names in os.walk(step_dir):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, step_dir)
            if rel in (MANIFEST, *REWRITTEN) or not stat.S_ISREG(os.lstat(path).st_mode):
                continue
            files[rel] = list(file_crc(path))
    body = {"format": FORMAT, "step": int(step), "files": files, "json_files": list(REWRITTEN),
            "tree": spec, "time": time.time()}
    manifest = {**body, "crc": zlib.crc32(_canonical(body))}
    tmp = os.path.join(step_dir, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(step_dir, MANIFEST))


def read_manifest(step_dir: str) -> dict:
    """The manifest of a checked step directory (see `check_step`)."""
    return runfiles.read_object(os.path.join(step_dir, MANIFEST), error=CheckpointError)


def check_step(step_dir: str, step: int) -> str | None:
    """None if the step directory is complete and intact, else why not (naming the path)."""
    try:
        st = os.lstat(step_dir)
    except OSError as e:
        return f"{step_dir}: cannot read ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return f"{step_dir}: is a symlink (jtrain neither follows nor deletes through one)"
    if not stat.S_ISDIR(st.st_mode):
        return f"{step_dir}: is a file, not a checkpoint directory"
    path = os.path.join(step_dir, MANIFEST)
    try:
        manifest = runfiles.read_object(path)
    except FileNotFoundError:
        return f"{path}: missing (the save never finished, or not a jtrain checkpoint)"
    except WorkdirError as e:
        return str(e)
    if manifest.get("format") != FORMAT:
        return f"{path}: unknown manifest format"
    body = {k: v for k, v in manifest.items() if k != "crc"}
    if manifest.get("crc") != zlib.crc32(_canonical(body)):
        return f"{path}: checksum mismatch (the manifest is damaged)"
    if manifest.get("step") != step:
        return f"{path}: records step {manifest.get('step')}, but the directory is step {step}"
    problem = _check_fields(manifest, path, step_dir)
    if problem:
        return problem
    for rel, (size, crc) in sorted(manifest["files"].items()):
        fpath = os.path.join(step_dir, rel)
        try:
            fst = os.lstat(fpath)
        except FileNotFoundError:
            return f"{fpath}: missing"
        except OSError as e:
            return f"{fpath}: cannot read ({e.strerror})"
        if not stat.S_ISREG(fst.st_mode):
            return f"{fpath}: not a regular file" + (" (a symlink)" if stat.S_ISLNK(
                fst.st_mode) else "")
        if fst.st_size != size:
            return f"{fpath}: {fst.st_size} bytes, {size} when saved (truncated or altered)"
        try:
            _, got = file_crc(fpath)
        except OSError as e:
            return f"{fpath}: cannot read ({e.strerror})"
        if got != crc:
            return f"{fpath}: CRC-32 mismatch (the bytes changed after the save)"
    for rel in manifest.get("json_files", []):
        fpath = os.path.join(step_dir, rel)
        try:
            runfiles.read_object(fpath)
        except FileNotFoundError:
            return f"{fpath}: missing"
        except WorkdirError as e:
            return str(e)
    return None


def _check_fields(manifest: dict, path: str, step_dir: str) -> str | None:
    """Why the manifest's files, json_files or tree are malformed (None if they are not):
    every listed path stays inside the step directory, through real directories only,
    so no check stats or reads a file outside it."""
    files, json_files = manifest.get("files"), manifest.get("json_files", [])
    if not isinstance(files, dict):
        return f"{path}: files: missing or not an object of path -> [size, crc]"
    if not isinstance(json_files, list):
        return f"{path}: json_files: not a list of paths"
    for rel, entry in files.items():
        if not (isinstance(entry, list) and len(entry) == 2
                and all(type(x) is int and x >= 0 for x in entry)):
            return f"{path}: files: {rel[:100]!r}: expected [size, crc], got {entry!r:.100}"
    for rel in [*files, *json_files]:
        problem = _inside(rel, step_dir)
        if problem:
            return f"{path}: files: {rel!s:.100}: {problem}"
    tree = manifest.get("tree", {})
    if not isinstance(tree, dict) or not all(
            isinstance(v, list) and len(v) == 2 and isinstance(v[0], list)
            and all(type(d) is int for d in v[0]) and isinstance(v[1], str)
            for v in tree.values()):
        return f"{path}: tree: expected an object of leaf path -> [shape, dtype]"
    return None


def _inside(rel, step_dir: str) -> str | None:
    """Why `rel` is not a plain relative path under `step_dir` (None if it is)."""
    if not isinstance(rel, str) or not rel or "\0" in rel or os.path.isabs(rel):
        return "not a relative path"
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "not a plain path inside the step directory ('..', '.' or an empty part)"
    for i in range(1, len(parts)):
        try:
            mode = os.lstat(os.path.join(step_dir, *parts[:i])).st_mode
        except OSError:
            return None  # the missing file is reported by the size check
        if not stat.S_ISDIR(mode):
            return "its folder is not a directory (a symlink?)"
    return None


def compare_trees(saved: dict, target: dict) -> str | None:
    """None if the saved tree spec equals the target's, else the first difference
    (parameters before optimizer state) and how many leaves differ in all."""
    problems = []
    for path in sorted(set(saved) | set(target),
                       key=lambda p: (not p.startswith("params/"), p)):
        if path not in target:
            s_shape, s_dtype = saved[path]
            problems.append(f"{path}: in the checkpoint ({tuple(s_shape)} {s_dtype}) but "
                            "not in the model")
        elif path not in saved:
            t_shape, t_dtype = target[path]
            problems.append(f"{path}: in the model ({tuple(t_shape)} {t_dtype}) but not in "
                            "the checkpoint")
        else:
            (s_shape, s_dtype), (t_shape, t_dtype) = saved[path], target[path]
            if list(s_shape) != list(t_shape) or s_dtype != t_dtype:
                problems.append(f"{path}: checkpoint has {tuple(s_shape)} {s_dtype}, the "
                                f"model {tuple(t_shape)} {t_dtype}")
    if not problems:
        return None
    more = len(problems) - 1
    return problems[0] + (f" (and {more} more leaves differ)" if more else "")


def is_step_name(name: str) -> bool:
    """A step directory's name: ASCII digits only (str.isdigit accepts '²', int() '٣')."""
    return bool(_STEP_NAME.fullmatch(name))


def parse_step(text) -> int | None:
    """The step number of a `--step` value or folder name, None if it is not one."""
    return int(text) if isinstance(text, str) and is_step_name(text) else None


def scan(directory: str) -> tuple[list[int], list[str], list[str]]:
    """(steps of plain step directories, unfinished-save entries, suspicious entries).

    Suspicious: a step name that is a symlink or not a directory, or one jtrain (orbax)
    never writes: leading zeros (`0030`; orbax addresses step 30 as `30`)."""
    steps, unfinished, suspicious = [], [], []
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return [], [], []
    for name in names:
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:  # renamed into place or deleted by the training process
            continue               # since the listing (a reader follows a live run)
        if TMP_MARK in name:
            unfinished.append(path)
        elif is_step_name(name):
            if stat.S_ISDIR(st.st_mode) and name == str(int(name)):
                steps.append(int(name))
            else:
                suspicious.append(path)
    return sorted(steps), unfinished, suspicious


def suspicious_problem(path: str) -> str | None:
    """Why a suspicious entry of `scan` is not a usable step directory."""
    name = os.path.basename(path)
    if name != str(int(name)):
        return (f"{path}: not a step directory name jtrain writes (step {int(name)} is "
                f"saved as {int(name)}; leading zeros, e.g. after a rename)")
    return check_step(path, int(name))


def remove_unfinished(path: str) -> None:
    """Delete a killed save's temporary directory; a symlink is only moved aside."""
    if os.path.islink(path) or not os.path.isdir(path):
        quarantine(path, "unfinished")
    else:
        shutil.rmtree(path, ignore_errors=True)


def quarantine(path: str, reason: str) -> str:
    """Move `path` (a symlink is moved as a link) into `<checkpoints>.damaged/`."""
    parent = os.path.dirname(path)
    dest_dir = parent.rstrip(os.sep) + ".damaged"
    os.makedirs(dest_dir, exist_ok=True)
    dest = os.path.join(dest_dir, f"{os.path.basename(path)}.{reason}.{int(time.time())}")
    n = 0
    while os.path.lexists(dest + (f".{n}" if n else "")):
        n += 1
    dest += f".{n}" if n else ""
    os.rename(path, dest)
    return dest
