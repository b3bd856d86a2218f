"""jtrain.paths.confined: a foreign name joined to a base stays inside it or is one
line. Hostile names are generated (hypothesis) against a base holding a folder, a link
pointing out of it and a link pointing inside it; the oracle is an independent reading
of the name's segments, and the result is checked on the file system."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtrain import errors
from jtrain.paths import confined

SEGMENTS = ["a", "sub", "..", ".", "", "out", "in", "x\\y", "nul\x00", "b.c", "..."]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("confine")
    outside = root / "outside"
    outside.mkdir()
    inner = root / "base"
    (inner / "sub").mkdir(parents=True)
    os.symlink(outside, inner / "out")       # inside the base, pointing out
    os.symlink(inner / "sub", inner / "in")  # inside the base, pointing inside
    return str(inner)


def expected_inside(name: str) -> bool:
    """The oracle: a plain relative path whose first segment is not the outward link."""
    if not name or name.startswith("/"):
        return False
    parts = name.split("/")
    plain = all(p not in ("", ".", "..") and "\\" not in p and "\x00" not in p
                for p in parts)
    return plain and parts[0] != "out"


names = st.one_of(
    st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=6).map("/".join),
    st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=4).map(
        lambda ps: "/" + "/".join(ps)),
    st.text(max_size=12),
)


@settings(deadline=None, derandomize=True, max_examples=400, database=None)
@given(name=names)
def test_confined_inside_or_one_line(base, name):
    try:
        path = confined(base, name)
    except errors.WorkdirError as e:
        line = errors.render(e)
        assert line.startswith("jtrain: workdir error: ") and "\n" not in line
        assert not expected_inside(name), (name, line)
        return
    assert expected_inside(name), (name, path)
    real, root = os.path.realpath(path), os.path.realpath(base)
    assert real.startswith(root + os.sep)
    assert path == os.path.join(base, *name.split("/"))


def test_known_escapes_refused(base):
    for name in ("../x", "a/../../x", "/etc/passwd", "a//b", "out/x", "a\\..\\x", "",
                 "a/./b", "a/\x00"):
        with pytest.raises(errors.WorkdirError):
            confined(base, name)
    assert confined(base, "in/x") == os.path.join(base, "in", "x")
