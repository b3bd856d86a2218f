"""`python -m jtrain.diff` (= `jtrain diff`, jtrain.cli.diff). The library: `diff_runs`
(jtrain.engine.diff)."""

from __future__ import annotations

if __name__ == "__main__":
    from jtrain import cli as _cli

    _cli.module_main("diff")

from jtrain.engine.diff import diff_runs, lines  # noqa: E402,F401
