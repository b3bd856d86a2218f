"""`python -m jtrain.diff` (= `jtrain diff`, jtrain.cli.diff). The library: `diff_runs`
(jtrain.engine.diff)."""

from __future__ import annotations

if __name__ == "__main__":
    from jtrain import cli as _cli

    _cli.module_main("diff")

from jtrain.engine.diff import diff_runs, lines  # noqa: E402,F401

__all__ = ["diff_runs", "main"]


def main(argv=None) -> int:
    """`jtrain diff ARGS` from Python: the exit code (after the one line of a failure).

    Examples:
        ```python
        import jtrain.diff

        code = jtrain.diff.main(["runs/a", "runs/b"])  # = jtrain diff runs/a runs/b
        ```
    """
    import sys

    from jtrain import cli

    return cli.run_command("diff", sys.argv[1:] if argv is None else argv)
