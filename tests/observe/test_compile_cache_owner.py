"""The compile cache is the user's own folder: JAX loads whatever entry it finds under a
key, so a folder that others can write picks the code a step runs. A configured folder
writable by group or others, or owned by another user, is one line naming
compile.cache_dir; the default folder is created 0700 and narrowed to 0700 when found
wider; a cache whose entry was swapped for another program's is refused before the
entry is read (JAX is left with no cache)."""

from __future__ import annotations

import os
import shutil
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtrain import errors
from jtrain.observe import compiles


@pytest.fixture
def restore_cache():
    yield
    compiles.configure_cache_for_reader("auto")  # conftest's set-up, for the next tests


def _refused(path) -> str:
    with pytest.raises(errors.ConfigError) as e:
        compiles.configure_cache(str(path))
    line = errors.render(e.value)
    assert "\n" not in line and errors.exit_code(e.value) == 2
    assert jax.config.jax_compilation_cache_dir is None
    return line


@pytest.mark.parametrize("mode, who", [(0o777, "group and others"), (0o770, "group"),
                                       (0o703, "others")], ids=["777", "770", "703"])
def test_a_folder_others_can_write_is_one_line(tmp_path, restore_cache, mode, who):
    cache = tmp_path / "cache"
    cache.mkdir()
    os.chmod(cache, mode)
    assert _refused(cache) == (
        f"jtrain: config error: compile.cache_dir: {cache} is writable by {who} (mode "
        f"{mode:o}): whoever writes there picks the code your steps run; chmod 700 "
        f"{cache}, or use a folder of your own")
    assert stat.S_IMODE(os.stat(cache).st_mode) == mode  # a configured folder: untouched


def test_a_folder_of_another_user_is_one_line(tmp_path, restore_cache):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    other = os.getuid() + 4242
    os.chown(cache, other, -1)
    assert _refused(cache) == (
        f"jtrain: config error: compile.cache_dir: {cache} is owned by uid {other}, not by "
        f"you (uid {os.getuid()}): a compiled step loaded from it runs as yours; use a "
        "folder of your own")


def test_the_default_folder_is_created_and_kept_0700(tmp_path, monkeypatch, restore_cache):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = compiles.configure_cache("auto")
    assert path == str(tmp_path / "xdg" / "jtrain" / "xla")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    for wider in (0o777, 0o755):
        os.chmod(path, wider)
        assert compiles.configure_cache("auto") == path
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    assert jax.config.jax_compilation_cache_dir == path


def _entries(path) -> set[str]:
    return {n for n in os.listdir(path) if not n.endswith("-atime")}


def test_a_swapped_entry_in_a_group_writable_cache_is_never_loaded(tmp_path, restore_cache):
    """A run with lr=0.5 and a run with lr=0.003 share a cache; someone who can write the
    folder copies the first's compiled step over the second's entry. The second run's
    cache is refused before that entry is read, and its step computes 0.003 * x."""
    cache = tmp_path / "cache"
    x = np.float32(2.0)
    compiles.configure_cache(str(cache))
    jax.jit(lambda v: v * jnp.float32(0.5))(x).block_until_ready()
    (strong,) = _entries(cache)
    jax.jit(lambda v: v * jnp.float32(0.003))(x).block_until_ready()
    (weak,) = _entries(cache) - {strong}
    os.chmod(cache, 0o770)  # shared with a group
    shutil.copyfile(cache / strong, cache / weak)  # the swap
    jax.clear_caches()
    _refused(cache)
    assert float(jax.jit(lambda v: v * jnp.float32(0.003))(x)) == np.float32(2.0) * \
        np.float32(0.003)
