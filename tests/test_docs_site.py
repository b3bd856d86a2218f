"""The docs site (mkdocs.yml, MkDocs + Material + mkdocstrings) builds with
`mkdocs build --strict`: every page under docs/ is on it and in its `nav:` (the order a
newcomer reads in), a broken link or a missing page fails the build, and the API page is
written from the public functions' docstrings."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from journey import user_env

REPO = Path(__file__).resolve().parents[1]


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                           str(config), "-d", str(site)], cwd=config.parent,
                          env=user_env(NO_MKDOCS_2_WARNING="1"), capture_output=True,
                          text=True, timeout=120)


def test_the_site_builds_strictly_with_every_page(tmp_path):
    proc = build(REPO / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stderr[-3000:]
    pages = {p.relative_to(REPO / "docs").with_suffix("").as_posix()
             for p in (REPO / "docs").rglob("*.md")}
    built = {p.parent.relative_to(tmp_path / "site").as_posix()
             for p in (tmp_path / "site").rglob("index.html")}
    assert {p for p in pages if p != "index"} <= built
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    for name in ("jtrain.engine.run.train", "jtrain.engine.assemble.build", "jtrain.mesh.make_mesh",
                 "jtrain.optim.make_optimizer", "jtrain.config.resolve"):
        assert f'id="{name}"' in api, name
    assert "Resumes from the newest checkpoint" in api  # train()'s docstring, rendered
    gpus = (tmp_path / "site" / "guide" / "gpus-and-clusters" / "index.html").read_text()
    assert "Not run by the test suite: needs an NVIDIA GPU" in gpus  # the marker, shown


def nav_pages(nav) -> list[str]:
    """The page paths of a mkdocs `nav:` tree, in order."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in nav_pages(value)]
    return [p for item in nav for p in nav_pages(item)]


def _site_config() -> dict:
    return yaml.safe_load((REPO / "mkdocs.yml").read_text())


def test_every_page_is_in_the_nav_once():
    """A page added under docs/ and left out of mkdocs.yml's nav fails here."""
    listed = nav_pages(_site_config()["nav"])
    pages = sorted(p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md"))
    assert sorted(set(pages) - set(listed)) == [], "add these pages to mkdocs.yml's nav"
    assert sorted(set(listed) - set(pages)) == [], "the nav names pages that do not exist"
    assert len(listed) == len(set(listed)), "a page is in the nav twice"
    assert listed[:3] == ["index.md", "guide/getting-started.md", "guide/concepts.md"]
    assert listed[-2:] == ["benchmarks.md", "design.md"]


def test_nav_pages_walks_sections():
    nav = [{"Home": "index.md"}, {"A": [{"x": "guide/x.md"}, {"B": [{"y": "y.md"}]}]}, "z.md"]
    assert nav_pages(nav) == ["index.md", "guide/x.md", "y.md", "z.md"]


def test_a_broken_link_fails_the_build(tmp_path):
    """The site's own config (less its nav) and hook on a small docs/ of two pages."""
    config = _site_config()
    del config["nav"]
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    (tmp_path / "docs" / "guide").mkdir(parents=True)
    shutil.copy(REPO / "docs" / "site_hooks.py", tmp_path / "docs" / "site_hooks.py")
    (tmp_path / "docs" / "index.md").write_text("# Home\n\n[later](guide/later.md)\n")
    (tmp_path / "README.md").write_text("# readme\n")
    page = tmp_path / "docs" / "guide" / "later.md"
    page.write_text("# Later\n\n[the readme](../../README.md), [home](../index.md)\n")
    assert build(tmp_path / "mkdocs.yml", tmp_path / "site").returncode == 0
    page.write_text("# Later\n\n[gone](../nope.md) and [old](../../NOPE.md)\n")
    proc = build(tmp_path / "mkdocs.yml", tmp_path / "site2")
    assert proc.returncode != 0
    assert "nope.md" in proc.stderr and "NOPE.md" in proc.stderr
