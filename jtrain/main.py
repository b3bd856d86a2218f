"""The command line: `python -m jtrain.main --config=configs/base.py --workdir=DIR`.

absl flags + ml_collections config files (`--config=configs/x.py:variant`,
`--config.optim.lr=3e-4`). Multi-host: pass --coordinator_address, --num_processes and
--process_id (or set JTRAIN_COORDINATOR, JTRAIN_NUM_PROCESSES, JTRAIN_PROCESS_ID), or
--distributed=auto on SLURM / Cloud TPU, where JAX finds its peers itself.

Every failure is one line on stderr and an exit code (docs/reference/exit_codes.md); its
traceback, and the logs of orbax, absl and grain, go to WORKDIR/train.log (on the
console too with --verbosity=2). A SIGTERM / SIGINT stops the run with its current step
saved, exit 0 (a signal during start-up: nothing new to save);
`--stopped_exit_code=N`: N instead (schedulers rerun it).
`--print_config` prints every key of the resolved config with its type, default, range
and description, and exits 0. stdout carries one JSON line, the run's result
(summary.json's scalars); everything else is on stderr.
`--verify_resume`: see jtrain.checkpoint.verify (exit 1 on FAIL).
"""

from __future__ import annotations

import sys

PROG = "python -m jtrain.main"


def define_flags(fv, sys_argv=None) -> None:
    """The train command's flags (jtrain.train_command)."""
    from jtrain import train_command

    train_command.define_flags(fv, sys_argv=sys_argv)


def parse_flags(argv, fv):
    """`argv` (the program first) parsed into `fv`; errors raise (jtrain.errors)."""
    from jtrain import train_command

    return train_command.parse_flags(argv, fv)


def cli(argv) -> None:
    """Parse `argv` (argv[0] is the program) on fresh flags and run: what `python -m
    jtrain.main` and `jtrain train` do. A failure or a non-zero exit code raises
    SystemExit(code) after its one line (jtrain.cli.run)."""
    from jtrain import cli as cli_lib
    from jtrain import train_command

    args = list(argv)[1:]
    overrides_from = [PROG, *cli_lib.split_free_form(args)[0]]
    code = cli_lib.run(PROG, lambda fv: train_command.define_flags(fv, overrides_from),
                       lambda fv, rest: train_command.main(fv, rest, args), args,
                       description=__doc__.split("\n\n", 1)[1],
                       run_log=train_command.run_log)
    if code:
        raise SystemExit(code)


def run() -> None:
    """`python -m jtrain.main`: process start-up first (jtrain.boot), then the command,
    then the fast exit (jtrain.exits)."""
    from jtrain import boot

    boot.start("train")
    cli(sys.argv)
    from jtrain import exits

    exits.exit_now()


if __name__ == "__main__":
    run()
