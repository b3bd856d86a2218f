"""MkDocs hook (mkdocs.yml `hooks:`): links from a page to repository files outside docs/
(`../README.md`, `../../configs/base.py`) work on GitHub but have no page on the site.
On the site they become the file's name in code; a link to a file that does not exist
is a warning, which `mkdocs build --strict` turns into an error, as for any broken link.
A code block's `<!-- not run: REASON -->` marker (tests/journeys/test_doc_examples.py)
is shown on the site as a line above the block, so the reader sees why it is not run."""

from __future__ import annotations

import logging
import os
import re

log = logging.getLogger("mkdocs.plugins.jtrain")
_LINK = re.compile(r"(?<!!)\[([^\]\n]+)\]\(([^)\s]+)\)")
_NOT_RUN = re.compile(r"^<!-- not run: (.*?) -->$", re.M)
_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)


def _outside(match, page_dir: str, docs_dir: str, repo: str, page: str) -> str:
    text, target = match.group(1), match.group(2)
    if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target):
        return match.group(0)  # a URL, an anchor, a site-absolute path: MkDocs checks them
    path = os.path.normpath(os.path.join(page_dir, target.split("#", 1)[0]))
    if path == docs_dir or path.startswith(docs_dir + os.sep):
        return match.group(0)  # a page of the site: MkDocs checks it
    if not os.path.exists(path):
        log.warning("Doc file '%s' links to '%s', which is not a file of the repository",
                    page, target)
        return match.group(0)
    name = os.path.relpath(path, repo)
    return text if text.strip("`") == name or text.strip("`") == os.path.basename(name) \
        else f"{text} (`{name}`)"


def on_page_markdown(markdown, page, config, files):
    docs_dir = os.path.abspath(config["docs_dir"])
    repo = os.path.dirname(os.path.abspath(config["config_file_path"]))
    page_dir = os.path.dirname(os.path.join(docs_dir, page.file.src_path))

    def rewrite(chunk: str) -> str:
        chunk = _NOT_RUN.sub(lambda m: f"*Not run by the test suite: {m.group(1)}.*\n", chunk)
        return _LINK.sub(lambda m: _outside(m, page_dir, docs_dir, repo, page.file.src_path),
                         chunk)

    out, last = [], 0
    for fence in _FENCE.finditer(markdown):  # code blocks stay as they are
        out += [rewrite(markdown[last:fence.start()]), fence.group(0)]
        last = fence.end()
    return "".join(out) + rewrite(markdown[last:])
