"""The docs site (mkdocs.yml, MkDocs + Material + mkdocstrings) builds with
`mkdocs build --strict`: every page under docs/ is on it, a broken link or a missing
page fails the build, and the API page is written from the public functions' docstrings."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

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
    assert {p for p in pages if p != "index"} <= built  # no nav list to forget a page in
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    for name in ("jtrain.engine.run.train", "jtrain.engine.assemble.build", "jtrain.mesh.make_mesh",
                 "jtrain.optim.make_optimizer", "jtrain.config.resolve"):
        assert f'id="{name}"' in api, name
    assert "Resumes from the newest checkpoint" in api  # train()'s docstring, rendered


def test_a_broken_link_fails_the_build(tmp_path):
    """The site's own config and hook on a small docs/ of two pages."""
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    (tmp_path / "docs" / "guide").mkdir(parents=True)
    shutil.copy(REPO / "docs" / "site_hooks.py", tmp_path / "docs" / "site_hooks.py")
    (tmp_path / "docs" / "index.md").write_text("# Home\n\n[later](guide/later.md)\n")
    (tmp_path / "README.md").write_text("# readme\n")
    page = tmp_path / "docs" / "guide" / "later.md"  # a guide added later: no nav to edit
    page.write_text("# Later\n\n[the readme](../../README.md), [home](../index.md)\n")
    assert build(tmp_path / "mkdocs.yml", tmp_path / "site").returncode == 0
    page.write_text("# Later\n\n[gone](../nope.md) and [old](../../NOPE.md)\n")
    proc = build(tmp_path / "mkdocs.yml", tmp_path / "site2")
    assert proc.returncode != 0
    assert "nope.md" in proc.stderr and "NOPE.md" in proc.stderr
