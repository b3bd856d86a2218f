"""`jtrain trust RUN` (= `python -m jtrain trust RUN`): shows the code a run's config.json
names, asks on the terminal, and signs it with the user's key, so that jtrain evaluate,
replay and report open it (the rule: jtrain.observe.trust). `--yes` signs without
asking (scripts); with no terminal and no `--yes` it refuses: nothing is signed unseen."""

from __future__ import annotations

import os
import sys

from jtrain.errors import UsageError
from jtrain.observe import runfiles, trust

PROG = "python -m jtrain trust"
DESCRIPTION = ("Trust a run from elsewhere: show the code its config.json names and, once "
               "you confirm, sign it with your key, so evaluate, replay and report open it.")


def define_flags(fv, argv=None) -> None:
    """One positional argument; --yes."""
    from absl import flags

    flags.DEFINE_bool("yes", False, "Sign without asking (for scripts): read what the "
                      "run's config.json names first.", flag_values=fv)


def main(fv, args, argv=None) -> int:
    if len(args) != 1:
        raise UsageError("usage: jtrain trust [--yes] RUN (a run directory)")
    run = args[0]
    shown = os.path.join(run, "config.json")
    try:
        config = runfiles.read_object(shown)
    except FileNotFoundError:
        raise UsageError("RUN", f"{run} is not a jtrain run (no config.json)") from None
    trust.user_key()  # a key that cannot sign says so before anything is asked
    named = trust.import_paths(config if isinstance(config, dict) else {})
    print(f"jtrain: trust: {shown} names "
          + (f"{len(named)} code path(s), run when it is opened:" if named else "no code"))
    for path, key in named:
        note = "" if path not in trust.UNSIGNED else "  (jtrain's, opens unsigned)"
        print(f"  {key} = {path}{note}")
    if not fv.yes:
        if not sys.stdin.isatty():
            raise UsageError("--yes", f"no terminal to confirm on; read what {shown} names, "
                                      f"then: jtrain trust --yes {run}")
        answer = input(f"Sign {shown} with {trust.key_file()}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            raise UsageError("RUN", f"not confirmed; {shown} is not signed")
    trust.sign(run)
    print(f"jtrain: trusted {shown}: signed with {trust.key_file()}")
    return 0
