"""compile.cache_max_gb: the least-recently used entries of the persistent compilation
cache go once it would pass the limit, and the directory is listed at a process's first
write and when its own writes would pass the limit, not at every write (JAX lists it,
stats every entry and reads every access time at each write: 0.35 CPU s a compile with
6,400 entries)."""

import json

import pytest
from jax._src import lru_cache

from journey import copy_project, run_python
from jtrain import internals

KB = 1024


@pytest.fixture
def patched():
    """jtrain's listing in place, as during a run."""
    with internals.compile_cache_patches() as names:
        yield names


def _cache(tmp_path, max_size, monkeypatch, patched):
    """A JAX LRUCache over tmp_path with jtrain's listing, and the list of its listings."""
    assert "list_once_per_process" in patched
    listings = []
    real = internals.evict_least_recent

    def counted(*args):
        listings.append(args[1])
        return real(*args)

    monkeypatch.setattr(internals, "evict_least_recent", counted)
    return lru_cache.LRUCache(str(tmp_path), max_size=max_size), listings


def _entries(path):
    return sorted(p.name[:-len("-cache")] for p in path.iterdir() if p.name.endswith("-cache"))


def test_the_least_recently_read_entries_go_and_the_directory_is_listed_rarely(
        tmp_path, monkeypatch, patched):
    cache, listings = _cache(tmp_path, 10 * KB, monkeypatch, patched)
    for key in "abcd":
        cache.put(key, bytes(2 * KB))
    assert _entries(tmp_path) == ["a", "b", "c", "d"] and len(listings) == 1  # 8 KB
    assert cache.get("a") == bytes(2 * KB)  # "a" is now the most recently used
    cache.put("e", bytes(2 * KB))  # 10 KB: fits, no listing
    assert len(listings) == 1
    cache.put("f", bytes(3 * KB))  # would be 13 KB: listed, b and c (the oldest) go
    assert len(listings) == 2 and _entries(tmp_path) == ["a", "d", "e", "f"]
    cache.put("a", bytes(2 * KB))  # already there: nothing to do
    assert len(listings) == 2
    sizes = sum(p.stat().st_size for p in tmp_path.iterdir() if p.name.endswith("-cache"))
    assert sizes <= 10 * KB and not (tmp_path / "b-atime").exists()
    assert not (tmp_path / "c-atime").exists()


def test_another_process_s_entries_count_at_the_next_listing(tmp_path, monkeypatch,
                                                             patched):
    cache, listings = _cache(tmp_path, 6 * KB, monkeypatch, patched)
    cache.put("mine", bytes(2 * KB))
    other = lru_cache.LRUCache(str(tmp_path), max_size=6 * KB)  # another process's
    other.put("theirs", bytes(3 * KB))
    cache.put("mine2", bytes(2 * KB))  # 4 KB of its own: no listing, 7 KB on disk
    assert len(listings) == 2 and len(_entries(tmp_path)) == 3
    cache.put("mine3", bytes(3 * KB))  # its own would pass 6 KB: listed, oldest go
    assert len(listings) == 3 and _entries(tmp_path) == ["mine2", "mine3"]


def test_a_run_with_a_small_limit_keeps_its_cache_under_it(tmp_path):
    """A user caps the cache at 64 KB (its largest entry is ~50 KB, all of a run's ~115
    KB): two runs compile more than that, and the folder stays under the cap, with no
    warning."""
    copy_project(tmp_path, "tabular")
    (tmp_path / "cfg.py").write_text(
        "from jtrain.config import defaults\n\n\ndef get_config():\n"
        "    c = defaults(model='mlp')\n    c.total_steps = 2\n"
        "    c.model.update(num_outputs=2, hidden=(16,))\n"
        "    c.data.update(source='tabular:make', batch_size=8)\n"
        "    c.compile.update(cache_dir='xla', cache_max_gb=64 / 2**20)\n"
        "    return c\n")
    for workdir in ("a", "b"):
        p = run_python(tmp_path, "-m", "jtrain.main", "--config=cfg.py",
                       f"--workdir={workdir}")
        assert p.returncode == 0, p.stderr[-2000:]
        assert "Warning" not in p.stderr, p.stderr[-2000:]
        folder = tmp_path / "xla"
        sizes = [f.stat().st_size for f in folder.iterdir() if f.name.endswith("-cache")]
        assert sizes and sum(sizes) <= 64 * KB, sizes
        assert json.loads((tmp_path / workdir / "summary.json").read_text())["step"] == 2
