"""`jtrain replay` (= `python -m jtrain.replay`, `python -m jtrain replay`): its flags and
its main; what it does is jtrain.engine.replay."""

from __future__ import annotations

import json
import sys

from absl import flags
from absl import logging as absl_logging

from jtrain.checkpoint import store
from jtrain.engine.replay import replay
from jtrain.errors import EXIT_DIFFERENT, UsageError

PROG = "python -m jtrain.replay"
DESCRIPTION = "Re-run a recorded step of a jtrain run and compare its state hash."


def define_flags(fv, argv=None) -> None:
    flags.DEFINE_integer("step", None, "The recorded step to replay (required).",
                         flag_values=fv)
    flags.DEFINE_string("workdir", None, "The run's directory (or give it as the argument).",
                        flag_values=fv)


def main(fv, args, argv=None) -> int:
    workdir = fv.workdir or (args[0] if len(args) == 1 else None)
    if workdir is None or len(args) > (0 if fv.workdir else 1):
        raise UsageError("usage: jtrain replay RUN --step S")
    if fv.step is None:
        raise UsageError("--step", "required: the recorded step to replay")
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every restore at INFO

    def say(line):
        sys.stderr.write(line + "\n")

    with store.local_copy(workdir) as local:  # a bucket's run: a staging copy
        result = replay(local, fv.step, say=say)
    if result["reproduced"]:
        say(f"jtrain: replay: step {fv.step} reproduced bitwise (hash "
            f"{result['replayed'][:16]}...)")
    else:
        where = (f"; first differing leaf against checkpoint {fv.step}: {result['leaf']} "
                 f"(max abs diff {result['max_abs_diff']:.3g})" if result["leaf"] else "")
        say(f"jtrain: replay: step {fv.step} NOT reproduced: recorded hash "
            f"{result['recorded'][:16]}..., replayed {result['replayed'][:16]}... (differing "
            f"parts: {', '.join(result.get('parts', [])) or '-'}){where}")
    if result["examples_match"] is False:
        say(f"jtrain: replay: the batch of step {fv.step} has other examples than recorded")
    print(json.dumps(result))
    return 0 if result["reproduced"] else EXIT_DIFFERENT
