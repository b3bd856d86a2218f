"""The one reader of a run's files. A run directory is data from someone else (downloaded,
shared), so every file in it is read the same way: opened without following a link
(O_NOFOLLOW) and without blocking (O_NONBLOCK: a FIFO planted in place of a ledger must
not hang the reader), refused unless it is a regular file, read up to a cap for its kind
of file, decoded strictly as UTF-8 and JSON, its top-level type and the fields its
caller needs checked. Anything else is one WorkdirError (or the caller's error class)
naming the file, the line where there is one, and what is wrong: never a traceback.

A missing file is FileNotFoundError, as from open(): the callers decide what absence
means. The writer beside it is jtrain.observe.layout (write_file, open_append)."""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable, Iterator

from jtrain.errors import WorkdirError, first_line

# Caps by kind of file, bytes: far above what a run writes, low enough that a hostile
# file cannot make a reader hold gigabytes. The kind's name is in the error.
SIGNATURE = ("signature", 4096)
JSON = ("JSON file", 64 << 20)
LEDGER = ("ledger", 1 << 30)

_TYPES = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
          dict: "an object", list: "a list"}


def read_bytes(path: str, cap: tuple[str, int] = JSON, error=WorkdirError) -> bytes:
    """The whole file at `path`, at most `cap` bytes; a link, a FIFO, a folder or a file
    over the cap is `error(path, why)`."""
    kind, limit = cap
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            raise
        why = ("is a symlink; jtrain reads a run's files, never through a link"
               if e.errno == errno.ELOOP else f"cannot be read ({e.strerror or first_line(e)})")
        raise error(path, why) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise error(path, "not a regular file (a FIFO, a device or a folder); "
                        "jtrain reads only regular files in a run")
        os.set_blocking(fd, True)
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise error(path, f"larger than {limit} bytes, the cap for a {kind}")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path: str, cap: tuple[str, int] = JSON, error=WorkdirError) -> str:
    """The file as strict UTF-8 text (read_bytes' checks)."""
    return decode(read_bytes(path, cap, error), path, error)


def decode(data: bytes, name: str, error=WorkdirError) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(name, f"not UTF-8 (byte {e.start})") from None


def read_object(path: str, fields: dict | None = None, error=WorkdirError,
                cap: tuple[str, int] = JSON) -> dict:
    """A JSON object file (config.json, summary.json, run.json, an eval's result, a
    manifest): its object, with `fields` {name: type or tuple of types} present and of
    their type."""
    return parse_object(read_bytes(path, cap, error), path, fields, error)


def parse_object(data: bytes, name: str, fields: dict | None = None,
                 error=WorkdirError) -> dict:
    """read_object's checks on bytes read from elsewhere (a bucket's object)."""
    value, problem = _parse(data, dict)
    if problem is None and fields:
        problem = check_fields(value, fields)
    if problem is not None:
        raise error(name, problem)
    return value


def check_fields(record: dict, fields: dict) -> str | None:
    """What is wrong with `record`'s `fields` ({name: type or types}), or None."""
    for key, types in fields.items():
        if key not in record:
            return f"{key}: missing"
        if not _is(record[key], types):
            want = " or ".join(_TYPES.get(t, t.__name__)
                               for t in (types if isinstance(types, tuple) else (types,)))
            return f"{key}: expected {want}, got {_shown(record[key])}"
    return None


def read_ledger(path: str, check: Callable[[dict], str | None] | None = None,
                error=WorkdirError, bad: Callable[[str], None] | None = None,
                cap: tuple[str, int] = LEDGER) -> list[dict]:
    """The records of an append-only JSONL ledger (metrics.jsonl, hashes.jsonl,
    skipped.jsonl, faults.jsonl, goodput.jsonl): one JSON object per line, `check(record)
    -> problem or None` on each. A torn last line (no newline: a kill mid-write) is
    skipped. Any other bad line is `error("<path>: line <n>", why)`, or, with
    `bad(message)`, reported there and skipped."""
    return parse_ledger(read_bytes(path, cap, error), path, check, error, bad)


def ledger_lines(data: bytes, name: str, check=None, error=WorkdirError,
                 bad=None) -> list[tuple[bytes, dict]]:
    """A ledger's good records with each one's line (its bytes, newline included), by
    read_ledger's rules, from its bytes."""
    return list(_lines(data, name, check, error, bad))


def parse_ledger(data: bytes, name: str, check=None, error=WorkdirError,
                 bad=None) -> list[dict]:
    """read_ledger's rules on bytes read from elsewhere (a bucket's object)."""
    return [record for _, record in _lines(data, name, check, error, bad)]


def _lines(data: bytes, name: str, check, error, bad) -> Iterator[tuple[bytes, dict]]:
    lines = data.splitlines(keepends=True)
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record, problem = _parse(line, dict)
        if problem is None and check is not None:
            problem = check(record)
        if problem is None:
            yield line, record
        elif number == len(lines) and not line.endswith(b"\n"):
            continue  # torn by a kill mid-append: the next write replaces it
        elif bad is not None:
            bad(f"{name}: line {number}: {problem}; skipped")
        else:
            raise error(f"{name}: line {number}", problem)


def _parse(data: bytes, top: type) -> tuple:
    try:
        value = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 (byte {e.start})"
    except (ValueError, RecursionError) as e:
        return None, f"not JSON ({first_line(e)[:80]})"
    if not isinstance(value, top):
        return None, f"not a JSON {'object' if top is dict else 'list'} ({_shown(value)})"
    return value, None


def _is(value, types) -> bool:
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool):
        return bool in types
    if float in types and isinstance(value, int):
        return True
    return isinstance(value, types)


def _shown(value) -> str:
    kind = {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value))
    return kind or repr(value)[:40]
