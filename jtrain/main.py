"""The command line: `python -m jtrain.main --config=configs/base.py --workdir=DIR`
(= `jtrain train`, `python -m jtrain train`): the train command, jtrain.cli.train, whose
DESCRIPTION says what it does."""

from __future__ import annotations

if __name__ == "__main__":
    from jtrain import cli as _cli

    _cli.module_main("train")

from jtrain.cli.train import PROG, define_flags, parse_flags  # noqa: E402,F401


def cli(argv) -> None:
    """Parse `argv` (argv[0] is the program) on fresh flags and run the train command:
    what `python -m jtrain.main` and `jtrain train` do. A failure or a non-zero exit code
    raises SystemExit(code) after its one line (jtrain.cli.runner.run)."""
    from jtrain import cli as cli_lib

    code = cli_lib.run_command("train", list(argv)[1:])
    if code:
        raise SystemExit(code)


def run() -> None:
    """`python -m jtrain.main`: start-up, the command, the fast exit (jtrain.cli)."""
    from jtrain import cli as cli_lib

    cli_lib.module_main("train")
