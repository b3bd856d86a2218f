"""`python -m jtrain.export` (= `jtrain export`, jtrain.cli.export). What it writes is
jtrain.checkpoint.export's (--format=hf: jtrain.checkpoint.hf_export's)."""

from __future__ import annotations

if __name__ == "__main__":
    from jtrain import cli as _cli

    _cli.module_main("export")

__all__ = ["main"]


def main(argv=None) -> int:
    """`jtrain export ARGS` from Python: the exit code (after the one line of a failure).

    Examples:
        ```python
        import jtrain.export

        code = jtrain.export.main(["--workdir=runs/a"])  # = jtrain export ...
        ```
    """
    import sys

    from jtrain import cli

    return cli.run_command("export", sys.argv[1:] if argv is None else argv)
