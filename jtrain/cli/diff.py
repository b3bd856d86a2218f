"""`jtrain diff` (= `python -m jtrain.diff`, `python -m jtrain diff`): its flags and
its main; what it does is jtrain.engine.diff."""

from __future__ import annotations

import json
import sys

from absl import logging as absl_logging

from jtrain.checkpoint import store
from jtrain.engine.diff import diff_runs, lines
from jtrain.errors import EXIT_DIFFERENT, UsageError

PROG = "python -m jtrain.diff"
DESCRIPTION = "Compare two jtrain runs: config, data, versions, state hashes, checkpoints."


def define_flags(fv, argv=None) -> None:
    """Two positional arguments, no flags."""


def main(fv, args, argv=None) -> int:
    if len(args) != 2:
        raise UsageError("usage: jtrain diff RUN_A RUN_B (two run directories)")
    absl_logging.set_verbosity(absl_logging.ERROR)  # orbax's notes on every restore
    with store.local_copy(args[0]) as a, store.local_copy(args[1]) as b:  # s3://, gs://
        result = diff_runs(a, b)
    for key, given in zip(("run_a", "run_b"), args, strict=True):
        if store.is_remote(given):  # named as given, not by its staging copy
            result[key] = given
    for line in lines(result):
        sys.stderr.write(line + "\n")
    print(json.dumps(result, default=str))
    return 0 if result["identical"] else EXIT_DIFFERENT
