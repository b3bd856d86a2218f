"""`python -m jtrain.replay` (= `jtrain replay`, jtrain.cli.replay). The library: `replay`
(jtrain.engine.replay)."""

from __future__ import annotations

if __name__ == "__main__":
    from jtrain import cli as _cli

    _cli.module_main("replay")

from jtrain.engine.replay import read_run, replay  # noqa: E402,F401

__all__ = ["replay", "main"]


def main(argv=None) -> int:
    """`jtrain replay ARGS` from Python: the exit code (after the one line of a failure).

    Examples:
        ```python
        import jtrain.replay

        code = jtrain.replay.main(["runs/a", "--step=150"])  # = jtrain replay runs/a --step=150
        ```
    """
    import sys

    from jtrain import cli

    return cli.run_command("replay", sys.argv[1:] if argv is None else argv)
