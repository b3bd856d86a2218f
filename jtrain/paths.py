"""Paths built from foreign names: a bucket key, an id read from a run's file, a trial's
folder from a study database. `confined(base, name)` is the one way such a name becomes
a path under `base`.

`os.path.join(base, name)` escapes `base` on a `..` segment and returns `name` itself
when it is absolute; a symbolic link inside `base` may point anywhere. So the name is
checked segment by segment first (no `..`, `.`, empty segment, absolute path, backslash
or NUL: a plain relative path with `/` between its parts), and the joined path, resolved
through every link that exists, must still lie inside the resolved base. Anything else
is one WorkdirError naming the name.
"""

from __future__ import annotations

import os

from jtrain.errors import WorkdirError


def segments(name: str, key: str | None = None) -> list[str]:
    """The parts of a foreign relative name (`a/b/c` -> [a, b, c]); a WorkdirError
    naming `key` (default: the name) when it is not a plain relative path."""
    key = key or repr(name)
    if not isinstance(name, str):
        raise WorkdirError(key, f"expected a relative path, got {type(name).__name__}")
    why = None
    if not name:
        why = "is empty"
    elif "\x00" in name:
        why = "holds a NUL character"
    elif "\\" in name:
        why = "holds a backslash"
    elif name.startswith("/"):
        why = "is an absolute path"
    else:
        parts = name.split("/")
        if any(p in ("", ".", "..") for p in parts):
            why = "holds an empty, '.' or '..' segment"
    if why is not None:
        raise WorkdirError(key, f"{why}: a name read from a run, a bucket or a study "
                           "must be a plain relative path inside its folder")
    return parts


def confined(base: str, name: str, key: str | None = None) -> str:
    """`base/name` for a foreign `name`, checked to stay inside `base` (links resolved);
    else a WorkdirError naming `key` (default: the name)."""
    parts = segments(name, key)
    path = os.path.join(base, *parts)
    root = os.path.realpath(base)
    real = os.path.realpath(path)
    if real == root or os.path.commonpath([root, real]) != root:
        raise WorkdirError(key or repr(name), "leads outside its folder (through a "
                           "symbolic link); refused")
    return path
