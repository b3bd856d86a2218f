"""The `jtrain` command (a console script, pyproject's [project.scripts]):

    jtrain train    --config=configs/base.py --workdir=runs/base    (= python -m jtrain.main)
    jtrain evaluate --workdir=runs/base [--step=best]               (= python -m jtrain.evaluate)
    jtrain export   --workdir=runs/base --out=exports/base          (= python -m jtrain.export)
    jtrain tune     --config=... --workdir=...                      (= python -m jtrain.tune)
    jtrain bench    overhead | data | checkpoint                    (= python -m jtrain.bench)
    jtrain diff     RUN_A RUN_B                                     (= python -m jtrain.diff)
    jtrain replay   RUN --step=S                                    (= python -m jtrain.replay)

Each subcommand runs its module's entry point with the rest of the command line, so the
start-up (jtrain.boot), flags, exit codes and one-line errors are the module's own
(jtrain.cli, jtrain.errors). The same
names mean the same things everywhere: `--workdir` is the run's directory in every
command. Logs and errors go to stderr; results (the final line, JSON) to stdout.
"""

from __future__ import annotations

import importlib
import sys

from jtrain import errors

# subcommand -> (module, one line of help)
COMMANDS = {
    "train": ("jtrain.main", "train (or resume) a run: --config=FILE --workdir=DIR"),
    "evaluate": ("jtrain.evaluate", "evaluate a checkpoint: --workdir=DIR [--step=N|best]"),
    "export": ("jtrain.export", "export parameters (safetensors): --workdir=DIR "
                                           "--out=DIR"),
    "tune": ("jtrain.tune", "hyperparameter search over runs: --config=FILE --workdir=DIR"),
    "bench": ("jtrain.bench.cli", "benchmarks: overhead, data, checkpoint"),
    "diff": ("jtrain.diff", "where two runs part: config, data, versions, state hashes: "
                            "RUN_A RUN_B"),
    "replay": ("jtrain.replay", "re-run a recorded step, compare its state hash: RUN "
                                "--step=S"),
}


def usage() -> str:
    return ("usage: jtrain {" + ",".join(COMMANDS) + "} [flags]   (jtrain COMMAND --help: "
            "its flags)\n\n" + "".join(f"  {k:<9} {v[1]}\n" for k, v in COMMANDS.items()))


def _entry(name: str):
    """The subcommand's `main(argv) -> exit code`; a UsageError when its module is not
    part of this installation."""
    module_name = COMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):  # the module itself, not its imports
            raise errors.UsageError(f"jtrain {name}: {module_name} is not installed in this "
                                    "version of jtrain") from None
        raise
    if name == "train":
        return lambda argv: module.cli([f"jtrain {name}", *argv]) or 0
    return module.main


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        (sys.stdout if argv else sys.stderr).write(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    try:
        if name not in COMMANDS:
            hint = [c for c in COMMANDS if c.startswith(name[:2])] if name[:2] else []
            raise errors.UsageError(f"jtrain {name}: unknown command; choose from "
                                    f"{', '.join(COMMANDS)}"
                                    + (f' (did you mean "{hint[0]}"?)' if hint else ""))
        entry = _entry(name)
    except errors.UsageError as e:
        sys.stderr.write(errors.render(e) + "\n")
        return e.exit_code
    return int(entry(rest) or 0)


def run() -> None:
    """The console script: process start-up first, as `python -m` does for the same
    command (jtrain.boot), and a finished `jtrain train` leaves by the same fast exit."""
    from jtrain import boot

    name = sys.argv[1] if len(sys.argv) > 1 else ""
    boot.start(name)
    code = main()
    if name == "train":
        from jtrain import exits

        exits.exit_now(code)
    sys.exit(code)
