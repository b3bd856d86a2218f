"""The command line: `python -m jtrain.main --config=configs/base.py --workdir=DIR`.

absl flags + ml_collections config files (`--config=configs/x.py:variant`,
`--config.optim.lr=3e-4`). Multi-host: pass --coordinator_address, --num_processes and
--process_id (or set JTRAIN_COORDINATOR, JTRAIN_NUM_PROCESSES, JTRAIN_PROCESS_ID), or
--distributed=auto on SLURM / Cloud TPU, where JAX finds its peers itself.

User errors print one line `jtrain: <kind> error: <key>: <why>` and exit 2; a checkpoint
that cannot be restored (damaged with --strict_restore, another model, a changed config)
exits 3; a failed checkpoint write exits 1. A run stopped by SIGTERM or SIGINT saves its
current step and exits 0 (jtrain.control). `--verify_resume`: see jtrain.checkpoint.verify.
"""

from __future__ import annotations

import os
import re
import sys

from absl import app, flags
from absl import logging as absl_logging
import ml_collections
from ml_collections import config_flags



def define_flags(fv: flags.FlagValues, sys_argv=None) -> None:
    # sys_argv: the argv that `--config.x.y=` overrides are read from (default sys.argv);
    # config_flags finds overrides there, not in the list the FlagValues is called with.
    config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/base.py:debug.",
                                    lock_config=True, flag_values=fv, sys_argv=sys_argv)
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
    flags.DEFINE_bool("all_hosts_log", False,
                      "Processes other than 0 print their lines too, prefixed [process i] "
                      "(= --config.log.all_hosts=true); by default they print errors only.",
                      flag_values=fv)
    flags.DEFINE_bool("strict_restore", False,
                      "A damaged checkpoint ends the run (exit 3) instead of falling back "
                      "to the previous one (= --config.checkpoint.strict_restore=true).",
                      flag_values=fv)
    flags.DEFINE_bool("verify_resume", False,
                      "Run the config uninterrupted and again with SIGKILLs at random "
                      "moments and restarts (in WORKDIR/reference, WORKDIR/interrupted); "
                      "compare the final state_sha256; exit 1 on a mismatch.",
                      flag_values=fv)
    flags.DEFINE_integer("verify_kills", 4, "--verify_resume: number of kills.",
                         flag_values=fv)
    flags.DEFINE_bool("verify_negative_control", False,
                      "--verify_resume with the data position not restored: must FAIL.",
                      flag_values=fv)


FLAGS = flags.FLAGS
define_flags(FLAGS)

EXIT_USER_ERROR = 2
EXIT_RESTORE_ERROR = 3  # a damaged (with --strict_restore) or mismatched checkpoint
EXIT_SAVE_ERROR = 1  # a checkpoint write failed (possibly in the background)
_RAW_ARGV: list[str] = []  # as parsed; --verify_resume reruns it


def fail(kind: str, message: str, code: int = EXIT_USER_ERROR):
    """One line on stderr, no traceback, a non-zero exit."""
    first = str(message).strip().splitlines()[0] if str(message).strip() else kind
    sys.stderr.write(f"jtrain: {kind} error: {first}\n")
    sys.stderr.flush()
    os._exit(code) if kind == "internal" else sys.exit(code)


def parse_flags(argv, fv: flags.FlagValues = FLAGS):
    """absl's parser, with config file and override errors turned into one line."""
    # config_flags loads every file as module "config_config" and reuses a loaded one:
    # a file without get_config() would borrow the previous file's (in-process runs).
    sys.modules.pop("config_config", None)
    # ...and logs a warning for get_config() -> None, which we report as the one line.
    def quiet(record):
        return "get_config() returned None" not in record.getMessage()

    absl_logging.get_absl_logger().addFilter(quiet)
    _RAW_ARGV[:] = list(argv)
    try:
        rest = fv(argv)
        if fv["config"].present:
            config = fv.config
            # config_flags defers a missing or unreadable file until the config is touched.
            getattr(config, "lock", None)
            if not isinstance(config, (dict, ml_collections.ConfigDict)):
                raise TypeError(f"get_config() returned {type(config).__name__}, "
                                "expected a ConfigDict")
        return rest
    except Exception as e:  # flags.Error, and what config_flags raises while loading
        fail("config", describe_flag_error(e, argv))
    finally:
        absl_logging.get_absl_logger().removeFilter(quiet)


def describe_flag_error(error: Exception, argv) -> str:
    """`<dotted.key or file>: <why>` for what absl / config_flags raised."""
    if isinstance(error, AttributeError) and error.args and isinstance(error.args[0], KeyError):
        error = error.args[0]  # config_flags wraps a typo below the top level: optim.lrr
    text = str(error.args[0] if isinstance(error, KeyError) and error.args else error)
    m = re.search(r"Attempting to lookup: ([\w.]+)", text) if isinstance(error, KeyError) else None
    if m:  # --config.optim.lr.x=1: a field below a plain value
        key = m.group(1)
        return f"{key}: unknown key; {key.rsplit('.', 1)[0]} is a value, not a section"
    if isinstance(error, KeyError):  # a typo in an override: 'optimzer' ... Did you mean
        bad = text.splitlines()[0].strip("'\"")
        hint = re.search(r'Did you mean "([^"]+)"', text)
        key = next((a.lstrip("-")[len("config."):].split("=")[0] for a in argv
                    if re.match(r"--?config\.", a) and bad in a.split("=")[0].split(".")), bad)
        return f"{key}: unknown key" + (f'; did you mean "{hint.group(1)}"?' if hint else "")
    if not isinstance(error, flags.Error):  # raised while loading the config file
        return _describe_file_error(error, _config_file(argv))
    m = re.match(r"flag --config\.([\w.]+)=(.*?): (.*)", text, re.S)
    if m:
        return f"{m.group(1)}: {_plain_why(m.group(3).strip().splitlines()[-1])}"
    m = re.match(r"Missing value for flag --config\.([\w.]+)", text)
    if m:
        return f"{m.group(1)}: missing value"
    m = re.match(r"Found --?config\.([\w.]+)\S* in argv before a value for --config", text)
    if m:
        return f"{m.group(1)}: override given before --config=...; put --config first"
    m = re.match(r"Flag --config\.([\w.]+) is provided after --config\.([\w.]+)", text)
    if m:
        return f"{m.group(1)}: given after --config.{m.group(2)}, and would overwrite it"
    m = re.match(r"flag --config=([^:]*)(:\S*)?: Error whilst parsing config file", text)
    if m:  # get_config raised: its own message is the last line of the traceback
        last = [ln for ln in text.strip().splitlines() if ln.strip()][-1]
        why = last.split(": ", 1)[-1]
        return why if why.startswith(f"{m.group(1)}:") else f"{m.group(1)}: {why}"
    m = re.match(r"Unknown command line flag '([^']+)'", text)
    if m:
        return f"--{m.group(1)}: unknown flag"
    return text.strip().splitlines()[0] if text.strip() else type(error).__name__


def _config_file(argv) -> str:
    """The path part of `--config=PATH[:variant]` (or `--config PATH`) in argv."""
    for i, a in enumerate(argv):
        m = re.match(r"--?config(=|$)(.*)", a)
        if m:
            value = m.group(2) if m.group(1) else (argv[i + 1] if i + 1 < len(argv) else "")
            return value.split(":", 1)[0] or "--config"
    return "--config"


def _describe_file_error(error: Exception, path: str) -> str:
    inner = error.__cause__ or error  # a deferred load error is re-raised as its cause
    if isinstance(inner, SyntaxError):
        return f"{path}: syntax error at line {inner.lineno}: {inner.msg}"
    if isinstance(inner, OSError):
        if inner.strerror:  # permission denied, is a directory, ...
            return f"{path}: cannot read: {inner.strerror.lower()}"
        if "Attempted" in str(inner):  # config_flags' file-not-found report
            return f"{path}: no such file"
        return f"{path}: cannot read: {str(inner).strip().splitlines()[0]}"
    if isinstance(inner, AttributeError) and "get_config" in str(inner):
        return f"{path}: has no get_config() function"
    if isinstance(inner, TypeError) and str(inner).startswith("get_config() returned"):
        return f"{path}: {inner}"
    first = str(inner).strip().splitlines()[0] if str(inner).strip() else ""
    return f"{path}: {type(inner).__name__}" + (f": {first}" if first else "")


def _plain_why(why: str) -> str:
    """Python's parse errors in the words config.py uses."""
    m = re.match(r"invalid literal for int\(\) with base 10: (.*)", why)
    if m:
        return f"must be an integer, got {m.group(1)}"
    m = re.match(r"could not convert string to float: (.*)", why)
    if m:
        return f"must be a number, got {m.group(1)}"
    m = re.match(r"\('Non-boolean argument to boolean flag', (.*)\)$", why)
    if m:
        return f"must be true or false, got {m.group(1)}"
    return why


def main(argv, fv: flags.FlagValues = FLAGS):
    if len(argv) > 1:
        fail("usage", f"unexpected arguments: {' '.join(argv[1:])}")
    if fv.config is None:
        fail("config", "--config: required, e.g. --config=configs/base.py")
    if not fv.workdir:
        fail("config", "--workdir: required (the run's directory)")
    # orbax and others log every save at INFO through absl; jtrain prints its own lines.
    absl_logging.set_verbosity(absl_logging.WARNING)
    if fv.verify_resume:
        from jtrain.checkpoint import verify

        sys.exit(verify.run_from_cli(_RAW_ARGV, fv.workdir, kills=fv.verify_kills,
                                     negative_control=fv.verify_negative_control))
    import jax

    if fv.distributed == "auto":
        jax.distributed.initialize()
    elif fv.num_processes > 1:
        if not fv.coordinator_address:
            fail("config", "--coordinator_address: required when --num_processes > 1")
        jax.distributed.initialize(coordinator_address=fv.coordinator_address,
                                   num_processes=fv.num_processes,
                                   process_id=fv.process_id)
    all_hosts = fv.all_hosts_log or bool(getattr(getattr(fv.config, "log", None), "all_hosts",
                                                 False))
    if jax.process_index() != 0 and not all_hosts:
        _quiet()

    from jtrain import checkpoint
    from jtrain import config as config_lib
    from jtrain import data as data_lib
    from jtrain.train import train

    try:
        config = fv.config
        if fv.strict_restore:
            config = config_lib.resolve(config)
            config.checkpoint.strict_restore = True
        if fv.all_hosts_log:
            config = config_lib.resolve(config)
            config.log.all_hosts = True
        train(config, fv.workdir)  # returns normally after a SIGTERM/SIGINT stop: exit 0
    except config_lib.ConfigError as e:
        fail("config", e)
    except data_lib.DataError as e:
        fail("data", e)
    except checkpoint.RestoreError as e:
        fail("restore", e, code=EXIT_RESTORE_ERROR)
    except checkpoint.CheckpointError as e:
        fail("checkpoint", e, code=EXIT_SAVE_ERROR)


def _quiet() -> None:
    """Processes other than 0: no warnings or log lines (jtrain.observe.console prints nothing
    there either), and stdout goes to /dev/null (C++ libraries such as gloo print there);
    errors still reach stderr."""
    import logging
    import warnings

    sys.stdout.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    warnings.simplefilter("ignore")
    absl_logging.set_verbosity(absl_logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)


def cli(argv) -> None:
    """Parse `argv` on fresh flags and run, without absl's app (for tests and embedding).
    User errors raise SystemExit(2) after printing their one line."""
    argv = list(argv)
    fv = flags.FlagValues()
    define_flags(fv, sys_argv=argv)
    main(parse_flags(argv, fv), fv)


def run():
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    run()
