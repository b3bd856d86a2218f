"""Every command, one dispatcher, one way in and out: `jtrain CMD ...` (= `python -m
jtrain CMD ...`; the commands: docs/reference/commands.md, the modules: WORKSPACE.md).

Each command (`jtrain/cli/<name>.py`, `jtrain/<name>/command.py` for tune and bench, a
floor above) has the same two functions, `define_flags(fv, argv)` and `main(fv, args,
argv) -> exit code`, and `PROG` / `DESCRIPTION`; `run_command` parses its flags and runs
it through the one error path (`jtrain.cli.runner.run`: one line and an exit code per
failure). Every form starts the same way (`start`: `jtrain.boot`, and the current
directory first on `sys.path`, as `python -m` puts it, so a `model.factory` module
beside the config imports under every form) and a finished train command leaves by the
same fast exit (`jtrain.cli.exits`). The commands here: train, evaluate, export, diff,
replay, trust, sample, tokenize; exit_codes is the exit-code table.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from typing import NamedTuple

from jtrain import errors


class Command(NamedTuple):
    module: str  # a jtrain/cli/<name>.py command, or jtrain/<package>/command.py
    prog: str  # the documented module form, used in usage lines
    about: str  # one line of help


COMMANDS = {
    "train": Command("jtrain.cli.train", "python -m jtrain.main",
                     "train (or resume) a run: --config=FILE --workdir=DIR"),
    "evaluate": Command("jtrain.cli.evaluate", "python -m jtrain.evaluate",
                        "evaluate a checkpoint: --workdir=DIR [--step=N|best]"),
    "export": Command("jtrain.cli.export", "python -m jtrain.export",
                      "export parameters (safetensors): --workdir=DIR --out=DIR"),
    "tune": Command("jtrain.tune.command", "python -m jtrain.tune",
                    "hyperparameter search over runs: --config=FILE --workdir=DIR"),
    "bench": Command("jtrain.bench.command", "python -m jtrain.bench",
                     "benchmarks of the engine itself (jtrain bench --help lists them)"),
    "diff": Command("jtrain.cli.diff", "python -m jtrain.diff",
                    "where two runs part: config, data, versions, state hashes: RUN_A RUN_B"),
    "replay": Command("jtrain.cli.replay", "python -m jtrain.replay",
                      "re-run a recorded step, compare its state hash: RUN --step=S"),
    "trust": Command("jtrain.cli.trust", "python -m jtrain trust",
                     "sign a run from elsewhere so its named code may run: RUN"),
    "sample": Command("jtrain.cli.sample", "python -m jtrain sample",
                      "continue prompts with a trained language model: RUN --prompt TEXT"),
    "tokenize": Command("jtrain.cli.tokenize", "python -m jtrain tokenize",
                        "text files -> token shards for data.name=tokens: --input --out"),
}


def usage() -> str:
    return ("usage: jtrain {" + ",".join(COMMANDS) + "} [flags]   (jtrain COMMAND --help: "
            "its flags)\n\n" + "".join(f"  {k:<9} {v.about}\n" for k, v in COMMANDS.items()))


def _module(name: str):
    """The command's module; a UsageError when it is not part of this installation."""
    module_name = COMMANDS[name].module
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):  # the module itself, not its imports
            raise errors.UsageError(f"jtrain {name}: {module_name} is not installed in this "
                                    "version of jtrain") from None
        raise


def run_command(name: str, argv) -> int:
    """Command `name` on `argv` (its flags and arguments): the exit code, after the one
    line of a failure."""
    from jtrain.cli import runner

    module = _module(name)
    argv = list(argv)
    prog = COMMANDS[name].prog
    overrides_from = [prog, *runner.split_free_form(argv)[0]]  # --config.a.b=... forms
    return runner.run(prog, lambda fv: module.define_flags(fv, overrides_from),
                      functools.partial(module.main, argv=argv), argv,
                      description=module.DESCRIPTION, run_log=getattr(module, "run_log", None))


def start(name: str) -> None:
    """What every form of every command does first: the current directory on sys.path
    (where `python -m` puts it; a console script's sys.path starts with its own bin/),
    then the process start-up (jtrain.boot)."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    from jtrain import boot

    boot.start(name)


def finish(name: str, code: int) -> None:
    """Leave with `code`: a train command by the fast exit (jtrain.cli.exits), every
    command that imported JAX without walking its heap at the teardown
    (control.signals.freeze_heap_at_exit)."""
    if "jax" in sys.modules:
        from jtrain.control import signals

        signals.freeze_heap_at_exit()
    if name == "train":
        from jtrain.cli import exits

        exits.exit_now(code)
    sys.exit(code)


def module_main(name: str) -> None:
    """`python -m jtrain.main | jtrain.evaluate | ...`: the command, then exit."""
    start(name)
    finish(name, run_command(name, sys.argv[1:]))


def main(argv=None) -> int:
    """`jtrain CMD ...` without the start-up and the exit: the exit code."""
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
        _module(name)
    except errors.UsageError as e:
        sys.stderr.write(errors.render(e) + "\n")
        return e.exit_code
    return run_command(name, rest)


def run() -> None:
    """The `jtrain` console script and `python -m jtrain`."""
    name = sys.argv[1] if len(sys.argv) > 1 else ""
    start(name)
    finish(name, main())
