"""The command line: `python -m jtrain.main --config=configs/base.py --workdir=DIR`.

absl flags + ml_collections config files (`--config=configs/x.py:variant`,
`--config.optim.lr=3e-4`). Multi-host: pass --coordinator_address, --num_processes and
--process_id (or set JTRAIN_COORDINATOR, JTRAIN_NUM_PROCESSES, JTRAIN_PROCESS_ID), or
--distributed=auto on SLURM / Cloud TPU, where JAX finds its peers itself.

Exit codes (README "Run control"): 0 done, stopped early, or stopped by SIGTERM / SIGINT
with its current step saved (a signal during start-up: nothing new to save); 2 a config,
data or usage error, one line `jtrain: <kind> error: <key>: <why>`, before any training;
3 a checkpoint that cannot be restored (damaged with --strict_restore, another model, a
changed config) or written; 4 training halted on non-finite values or repeated loss
spikes; 5 a hang (watchdog.timeout_s), no clean stop within checkpoint.grace_seconds, or a
failed peer (a collective with another process broke).
`--verify_resume`: see jtrain.checkpoint.verify (exit 1 on FAIL).
"""

from __future__ import annotations

import os
import sys
import traceback

import ml_collections
from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from jtrain import cli as cli_lib
from jtrain import errors


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

_RAW_ARGV: list[str] = []  # as parsed; --verify_resume reruns it


def fail(error: errors.JtrainError):
    """Its one line on stderr, no traceback, its exit code."""
    sys.stderr.write(errors.render(error) + "\n")
    sys.stderr.flush()
    _exit(error.exit_code)


def _exit(code: int):
    if _multi_process():  # jax.distributed's shutdown at exit waits for peers that may be
        sys.stdout.flush()  # gone: leave at once
        os._exit(code)
    sys.exit(code)


def _multi_process() -> bool:
    jax = sys.modules.get("jax")
    try:
        return jax is not None and jax.distributed.is_initialized() and \
            jax.process_count() > 1
    except Exception:  # noqa: BLE001 - no backend: one process
        return False


def _peer_failure(e: BaseException) -> errors.PeerError | None:
    """A runtime error in a multi-process run that is a failed collective."""
    jax = sys.modules.get("jax")
    if jax is None or not _multi_process() or not isinstance(e, jax.errors.JaxRuntimeError):
        return None
    first = errors.first_line(e)
    if "RESOURCE_EXHAUSTED" in first:  # out of memory: not a peer's fault
        return None
    return errors.PeerError(f"a collective with the other processes failed ({first[:200]});"
                            " another process probably stopped: see its output; a "
                            "restart resumes from the newest checkpoint")


def parse_flags(argv, fv: flags.FlagValues = FLAGS):
    """absl's parser, with config file and override errors turned into one line."""
    # config_flags loads every file as module "config_config" and reuses a loaded one:
    # a file without get_config() would borrow the previous file's (in-process runs).
    sys.modules.pop("config_config", None)
    # ...and logs a warning for get_config() -> None, which we report as the one line.
    def quiet(record):
        return "get_config() returned None" not in record.getMessage()

    if cli_lib.wants_help(argv[1:]):
        help_fv = flags.FlagValues()
        define_flags(help_fv, sys_argv=argv[:1])
        cli_lib.print_help("python -m jtrain.main", help_fv, __doc__.split("\n\n", 1)[1])
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
    except Exception as e:  # noqa: BLE001 - flags.Error, and what config_flags raises loading
        key, _, why = cli_lib.describe_flag_error(e, argv).partition(": ")
        fail(errors.ConfigError(key, why))
    finally:
        absl_logging.get_absl_logger().removeFilter(quiet)


def main(argv, fv: flags.FlagValues = FLAGS):
    try:
        _run(argv, fv)  # returns normally after a SIGTERM/SIGINT stop: exit 0
    except errors.JtrainError as e:
        fail(e)
    except Exception as e:
        peer = _peer_failure(e)
        if peer is not None:
            fail(peer)
        if _multi_process():  # a bug: its traceback, then out without the shutdown wait
            traceback.print_exc()
            sys.stderr.flush()
            _exit(1)
        raise


def _run(argv, fv: flags.FlagValues) -> None:
    if len(argv) > 1:
        raise errors.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if fv.config is None:
        raise errors.ConfigError("--config", "required, e.g. --config=configs/base.py")
    if not fv.workdir:
        raise errors.ConfigError("--workdir", "required (the run's directory)")
    # orbax and others log every save at INFO through absl; jtrain prints its own lines.
    absl_logging.set_verbosity(absl_logging.WARNING)
    if fv.verify_resume:
        from jtrain.checkpoint import verify

        sys.exit(verify.run_from_cli(_RAW_ARGV, fv.workdir, kills=fv.verify_kills,
                                     negative_control=fv.verify_negative_control))
    if getattr(fv.config, "deterministic", False):  # XLA_FLAGS before the backend starts
        from jtrain import precision

        precision.set_deterministic(True)
    import jax

    if fv.distributed == "auto":
        try:
            jax.distributed.initialize()
        except ValueError as e:  # JAX found no cluster environment (SLURM, TPU, ...)
            raise errors.ConfigError("--distributed=auto", "no cluster detected here ("
                                     f"{errors.first_line(e)}); pass --coordinator_address, "
                                     "--num_processes and --process_id instead") from None
    elif fv.num_processes > 1:
        if not fv.coordinator_address:
            raise errors.ConfigError("--coordinator_address",
                                     "required when --num_processes > 1")
        jax.distributed.initialize(coordinator_address=fv.coordinator_address,
                                   num_processes=fv.num_processes,
                                   process_id=fv.process_id)
    all_hosts = fv.all_hosts_log or bool(getattr(getattr(fv.config, "log", None), "all_hosts",
                                                 False))
    if jax.process_index() != 0 and not all_hosts:
        _quiet()

    from jtrain.train import train

    # Flags that stand for config keys go into a copy; train() resolves and validates it.
    config = fv.config.to_dict() if hasattr(fv.config, "to_dict") else dict(fv.config)
    if fv.strict_restore:
        config.setdefault("checkpoint", {})["strict_restore"] = True
    if fv.all_hosts_log:
        config.setdefault("log", {})["all_hosts"] = True
    train(config, fv.workdir)


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
