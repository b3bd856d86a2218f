"""`jtrain trust RUN` (= `python -m jtrain trust RUN`): shows the code a run's config.json
names and signs it with the user's key, so that jtrain evaluate, replay and report open
it (the rule: jtrain.observe.trust)."""

from __future__ import annotations

import json
import os

from jtrain.errors import UsageError
from jtrain.observe import trust

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
        with open(os.path.join(run, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        raise UsageError("RUN", f"{run} is not a jtrain run (no readable config.json)"
                         ) from None
    paths = trust.untrusted(config if isinstance(config, dict) else {})
    trust.sign(run)
    named = (f"it names code that will run when it is opened: {trust.listing(paths)}"
             if paths else "it names no code beyond what opens unsigned")
    print(f"jtrain: trusted {os.path.join(run, 'config.json')}: {named}; signed with "
          f"{trust.key_file()}")
    return 0
