"""The command line: `python -m jtrain.main --config=configs/base.py --workdir=DIR`.

absl flags + ml_collections config files (`--config=configs/x.py:variant`,
`--config.optim.lr=3e-4`). Multi-host: pass --coordinator_address, --num_processes and
--process_id (or set JTRAIN_COORDINATOR, JTRAIN_NUM_PROCESSES, JTRAIN_PROCESS_ID), or
--distributed=auto on SLURM / Cloud TPU, where JAX finds its peers itself.

User errors print one line `jtrain: <kind> error: <key>: <why>` and exit 2.
"""

from __future__ import annotations

import os
import re
import sys

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags



def define_flags(fv: flags.FlagValues) -> None:
    config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/base.py:debug.",
                                    lock_config=True, flag_values=fv)
    flags.DEFINE_string("workdir", None, "The run's directory: checkpoints, logs, summary.",
                        flag_values=fv)
    flags.DEFINE_string("coordinator_address", os.environ.get("JTRAIN_COORDINATOR"),
                        "host:port of process 0, for multi-process runs.", flag_values=fv)
    flags.DEFINE_integer("num_processes", int(os.environ.get("JTRAIN_NUM_PROCESSES", "1")),
                         "Number of processes in a multi-process run.", flag_values=fv)
    flags.DEFINE_integer("process_id", int(os.environ.get("JTRAIN_PROCESS_ID", "0")),
                         "This process's index in a multi-process run.", flag_values=fv)
    flags.DEFINE_enum("distributed", "off", ["off", "auto"],
                      "auto: jax.distributed.initialize() with cluster auto-detection.",
                      flag_values=fv)


FLAGS = flags.FLAGS
define_flags(FLAGS)

EXIT_USER_ERROR = 2


def fail(kind: str, message: str, code: int = EXIT_USER_ERROR):
    """One line on stderr, no traceback, a non-zero exit."""
    first = str(message).strip().splitlines()[0] if str(message).strip() else kind
    sys.stderr.write(f"jtrain: {kind} error: {first}\n")
    sys.stderr.flush()
    os._exit(code) if kind == "internal" else sys.exit(code)


def parse_flags(argv, fv: flags.FlagValues = FLAGS):
    """absl's parser, with config file and override errors turned into one line."""
    try:
        return fv(argv)
    except Exception as e:  # flags.Error, and what config_flags raises while loading
        fail("config", describe_flag_error(e, argv))


def describe_flag_error(error: Exception, argv) -> str:
    """`<dotted.key or file>: <why>` for what absl / config_flags raised."""
    text = str(error.args[0] if isinstance(error, KeyError) and error.args else error)
    if isinstance(error, KeyError):  # a typo in an override: 'optimzer' ... Did you mean
        bad = text.splitlines()[0].strip("'\"")
        hint = re.search(r'Did you mean "([^"]+)"', text)
        key = next((a[len("--config."):].split("=")[0] for a in argv
                    if a.startswith("--config.") and bad in a.split("=")[0].split(".")), bad)
        return f"{key}: unknown key" + (f'; did you mean "{hint.group(1)}"?' if hint else "")
    m = re.match(r"flag --config\.([\w.]+)=(.*?): (.*)", text, re.S)
    if m:
        return f"{m.group(1)}: {m.group(3).strip().splitlines()[-1]}"
    m = re.match(r"Missing value for flag --config\.([\w.]+)", text)
    if m:
        return f"{m.group(1)}: missing value"
    m = re.match(r"flag --config=([^:]+)(:\S*)?: Error whilst parsing config file", text)
    if m:  # get_config raised: its own message is the last line of the traceback
        last = [ln for ln in text.strip().splitlines() if ln.strip()][-1]
        return f"{m.group(1)}: {last.split(': ', 1)[-1]}"
    m = re.search(r"Attempted.*?\n\s*(\S+)\n\s*(\[Errno[^\n]*)", text, re.S)
    if m:
        return f"{m.group(1)}: {m.group(2).split(': ', 1)[0]} {m.group(2).split(': ')[1]}"
    m = re.match(r"Unknown command line flag '([^']+)'", text)
    if m:
        return f"--{m.group(1)}: unknown flag"
    return text.strip().splitlines()[0] if text.strip() else type(error).__name__


def main(argv, fv: flags.FlagValues = FLAGS):
    if len(argv) > 1:
        fail("usage", f"unexpected arguments: {' '.join(argv[1:])}")
    if fv.config is None:
        fail("config", "--config: required, e.g. --config=configs/base.py")
    if not fv.workdir:
        fail("config", "--workdir: required (the run's directory)")
    # orbax and others log every save at INFO through absl; jtrain prints its own lines.
    absl_logging.set_verbosity(absl_logging.WARNING)
    import jax

    if fv.distributed == "auto":
        jax.distributed.initialize()
    elif fv.num_processes > 1:
        if not fv.coordinator_address:
            fail("config", "--coordinator_address: required when --num_processes > 1")
        jax.distributed.initialize(coordinator_address=fv.coordinator_address,
                                   num_processes=fv.num_processes,
                                   process_id=fv.process_id)

    from jtrain import config as config_lib
    from jtrain import data as data_lib
    from jtrain import train as train_lib

    try:
        train_lib.train(fv.config, fv.workdir)
    except config_lib.ConfigError as e:
        fail("config", e)
    except data_lib.DataError as e:
        fail("data", e)


def cli(argv) -> None:
    """Parse `argv` on fresh flags and run, without absl's app (for tests and embedding).
    User errors raise SystemExit(2) after printing their one line."""
    fv = flags.FlagValues()
    define_flags(fv)
    main(parse_flags(list(argv), fv), fv)


def run():
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    run()
