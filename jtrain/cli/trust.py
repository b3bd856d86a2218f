"""`jtrain trust RUN` (= `python -m jtrain trust RUN`): shows the code a run's config.json
names and signs it with the user's key, so that jtrain evaluate, replay and report open
it (the rule: jtrain.observe.trust)."""

from __future__ import annotations

import os

from jtrain.errors import UsageError
from jtrain.observe import runfiles, trust

PROG = "python -m jtrain trust"
DESCRIPTION = ("Trust a run from elsewhere: show the code its config.json names and sign "
               "it with your key, so evaluate, replay and report open it.")


def define_flags(fv, argv=None) -> None:
    """One positional argument, no flags."""


def main(fv, args, argv=None) -> int:
    if len(args) != 1:
        raise UsageError("usage: jtrain trust RUN (a run directory)")
    run = args[0]
    try:
        config = runfiles.read_object(os.path.join(run, "config.json"))
    except FileNotFoundError:
        raise UsageError("RUN", f"{run} is not a jtrain run (no config.json)") from None
    paths = trust.untrusted(config)
    trust.sign(run)
    named = (f"it names code that will run when it is opened: {trust.listing(paths)}"
             if paths else "it names no code outside jtrain")
    print(f"jtrain: trusted {os.path.join(run, 'config.json')}: {named}; signed with "
          f"{trust.key_file()}")
    return 0
