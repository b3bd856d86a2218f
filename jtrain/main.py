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
peer missing at start-up, failed or silent (distributed.*; one line, jtrain.multihost); 6
the disk holding the workdir is full (free space, rerun the same command); 1 a bug (`jtrain: internal error: ...`). The
workdir being a file, read-only or not writable is exit 2 (`jtrain: workdir error`).
Every failure is one line on stderr (jtrain.errors); its traceback, and the logs of
orbax, absl and grain, go to WORKDIR/train.log (on the console too with --verbosity=2).
`--print_config` prints every key of the resolved config with its type, default, range
and description, and exits 0. stdout carries one JSON line, the run's result
(summary.json's scalars); everything else is on stderr.
`--stopped_exit_code=N`: N instead of 0 after a SIGTERM / SIGINT stop (schedulers rerun it).
`--verify_resume`: see jtrain.checkpoint.verify (exit 1 on FAIL).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import ml_collections
from absl import flags
from absl import logging as absl_logging
from ml_collections import config_flags

from jtrain import cli as cli_lib
from jtrain import errors
from jtrain.observe import liblogs
from jtrain.observe.redact import redact_text
from jtrain.multihost import monitor


DEBUG_MULTIHOST_EVERY = 10
EXIT_LINGER_S = 5.0  # process 0, failing: how long it waits for its peers to leave first


def define_flags(fv: flags.FlagValues, sys_argv=None) -> None:
    # sys_argv: the argv that `--config.x.y=` overrides are read from (default sys.argv);
    # config_flags finds overrides there, not in the list the FlagValues is called with.
    config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/base.py:debug.",
                                    lock_config=True, flag_values=fv, sys_argv=sys_argv)
    flags.DEFINE_string("workdir", None, "The run's directory: checkpoints, logs, summary.",
                        flag_values=fv)
    flags.DEFINE_string("coordinator_address", os.environ.get("JTRAIN_COORDINATOR"),
                        "host:port of process 0, for multi-process runs.", flag_values=fv)
    flags.DEFINE_integer("num_processes", _env_int("JTRAIN_NUM_PROCESSES", 1),
                         "Number of processes in a multi-process run.", flag_values=fv)
    flags.DEFINE_integer("process_id", _env_int("JTRAIN_PROCESS_ID", 0),
                         "This process's index in a multi-process run.", flag_values=fv)
    flags.DEFINE_enum("distributed", "off", ["off", "auto"],
                      "auto: jax.distributed.initialize() with cluster auto-detection.",
                      flag_values=fv)
    flags.DEFINE_bool("all_hosts_log", False,
                      "Processes other than 0 print their lines too, prefixed [process i] "
                      "(= --config.log.all_hosts=true); by default they print errors only.",
                      flag_values=fv)
    flags.DEFINE_bool("debug_multihost", False,
                      "Every distributed.debug_every_steps steps (default "
                      f"{DEBUG_MULTIHOST_EVERY}) all processes check that they are at the "
                      "same step with the same config hash; else one line, exit 5.",
                      flag_values=fv)
    flags.DEFINE_integer("stopped_exit_code", 0,
                         "Exit status after a SIGTERM / SIGINT stopped the run (its step "
                         "saved); non-zero tells a scheduler that restarts failed tasks to "
                         "run it again, which resumes (launch/k8s uses 75).",
                         lower_bound=0, upper_bound=255, flag_values=fv)
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
    flags.DEFINE_bool("dry_run", False,
                      "Build the mesh, abstract state and shardings, compile the train and "
                      "eval steps without running them; print per-device memory and every "
                      "parameter's sharding; exit 2 naming a parameter the mesh cannot "
                      "shard as asked (jtrain.dry_run).", flag_values=fv)
    flags.DEFINE_integer("dry_run_devices", 0,
                         "--dry_run on this many fake CPU devices (e.g. 64 for a big "
                         "topology); 0 = the devices this machine has.", flag_values=fv)
    flags.DEFINE_bool("verify_negative_control", False,
                      "--verify_resume with the data position not restored: must FAIL.",
                      flag_values=fv)
    flags.DEFINE_integer("verbosity", None, "0: errors and the result; 1: + header, progress"
                         " and evals (default); 2: + debug lines and the logs of orbax, absl "
                         "and grain on the console (= --config.log.verbosity=N).",
                         lower_bound=0, upper_bound=2, flag_values=fv)
    flags.DEFINE_bool("print_config", False, "Print every key of the resolved config (value,"
                      " type, default, range or choices, description) and exit 0; "
                      "--workdir not needed.", flag_values=fv)

def _env_int(name: str, default: int) -> int:
    """An integer from the environment (launch/local.sh sets these); one line if not."""
    raw = os.environ.get(name, "")
    try:
        return int(raw) if raw.strip() else default
    except ValueError:
        fail(errors.UsageError(f"{name}={raw!r} in the environment: expected an integer"))


_RAW_ARGV: list[str] = []  # as parsed; --verify_resume reruns it


def fail(error: errors.JtrainError):
    """Its one line on stderr, no traceback, its exit code."""
    sys.stderr.write(errors.render(error) + "\n")
    sys.stderr.flush()
    _exit(error.exit_code)


def _exit(code: int):
    # Peers report this status instead of a dead process; process 0 leaves last.
    monitor.finished(code, linger_s=EXIT_LINGER_S if code else 0.0)
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
    monitor.peer_failed()  # the peer monitor names the peer and exits 5, if it can
    return errors.PeerError(f"a collective with the other processes failed ({first[:200]});"
                            " another process probably stopped: see its output; a "
                            "restart resumes from the newest checkpoint")


def parse_flags(argv, fv: flags.FlagValues):
    """absl's parser, with config file and override errors turned into one line.
    `--config.data.kwargs.NAME=value` / `--config.model.kwargs.NAME=value` (free-form
    dicts: new names allowed) are applied here, after the file is loaded."""
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
    argv, free_form = cli_lib.split_free_form(argv)
    try:
        rest = fv(argv)
        if fv["config"].present:
            config = fv.config
            # config_flags defers a missing or unreadable file until the config is touched.
            getattr(config, "lock", None)
            if not isinstance(config, (dict, ml_collections.ConfigDict)):
                raise TypeError(f"get_config() returned {type(config).__name__}, "
                                "expected a ConfigDict")
            cli_lib.apply_free_form(config, free_form)
        elif free_form:
            raise errors.ConfigError(free_form[0][0], "override given without --config")
        return rest
    except errors.JtrainError as e:
        fail(e)
    except SystemExit as e:  # get_config() called sys.exit: it is the file's error
        fail(errors.ConfigError(cli_lib.config_file(argv), "get_config() called sys.exit("
                                f"{e.code!r}) while the config was loading"))
    except Exception as e:  # noqa: BLE001 - flags.Error, and what config_flags raises loading
        key, why = cli_lib.describe_flag_error(e, argv)
        if key.startswith("--") and not key.startswith("--config"):  # not a config key
            fail(errors.UsageError(key, why))
        fail(errors.ConfigError(key, why))
    finally:
        absl_logging.get_absl_logger().removeFilter(quiet)


def main(argv, fv: flags.FlagValues):
    undo_logs = lambda: None  # noqa: E731
    try:
        undo_logs = _route_logs(fv)
        _run(argv, fv)  # returns normally after a SIGTERM/SIGINT stop: exit 0
    except errors.JtrainError as e:
        fail(_logged(errors.classify(e, fv.workdir or ""), fv))
    except Exception as e:  # noqa: BLE001 - every failure is one line (jtrain.errors)
        known = _peer_failure(e) or errors.classify(e, fv.workdir or "")
        if isinstance(known, errors.JtrainError):
            fail(_logged(known, fv))
        line = errors.render(e)
        if liblogs.append_traceback(fv.workdir, line, e):
            line += f" (traceback in {os.path.join(fv.workdir, liblogs.LOG_FILE)})"
        else:
            traceback.print_exc()
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        _exit(1)
    finally:
        undo_logs()


def _route_logs(fv) -> callable:
    """Library logs into WORKDIR/train.log unless verbosity 2 (jtrain.observe.liblogs)."""
    verbosity = fv.verbosity
    if verbosity is None:
        log = getattr(fv.config, "log", None) if fv.config is not None else None
        verbosity = getattr(log, "verbosity", 1) if log is not None else 1
    if not fv.workdir or fv.print_config:
        return lambda: None
    return liblogs.to_train_log(fv.workdir, int(verbosity))


def _logged(error: errors.JtrainError, fv) -> errors.JtrainError:
    """The error, its line and traceback appended to WORKDIR/train.log once the run has
    one (an error before the run started leaves the workdir as it was)."""
    if fv.workdir and os.path.isfile(os.path.join(fv.workdir, liblogs.LOG_FILE)):
        liblogs.append_traceback(fv.workdir, errors.render(error), error)
    return error


def _run(argv, fv: flags.FlagValues) -> None:
    if len(argv) > 1:
        raise errors.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if fv.config is None:
        raise errors.ConfigError("--config", "required, e.g. --config=configs/base.py")
    if fv.print_config:
        from jtrain.config import reference

        sys.stdout.write(reference.resolved_text(_config_dict(fv)))
        sys.stdout.flush()
        return
    if not fv.workdir:
        raise errors.ConfigError("--workdir", "required (the run's directory)")
    # orbax and others log every save at INFO through absl; jtrain prints its own lines.
    absl_logging.set_verbosity(absl_logging.WARNING)
    if fv.verify_resume:
        from jtrain.checkpoint import verify

        sys.exit(verify.run_from_cli(_RAW_ARGV, fv.workdir, kills=fv.verify_kills,
                                     negative_control=fv.verify_negative_control))
    if fv.dry_run:
        _dry_run(fv)
        return
    if getattr(fv.config, "deterministic", False):  # XLA_FLAGS before the backend starts
        from jtrain import precision

        precision.set_deterministic(True)
    import time

    import jax

    from jtrain import config as config_lib
    from jtrain.multihost import start
    from jtrain.train import check_workdir, run_from_cli

    config = _config_dict(fv)
    # A bad key or value, or a gs:// workdir: one line before waiting for any peer.
    config_lib.resolve_for_run(config)
    check_workdir(fv.workdir)
    t_distributed = time.perf_counter()  # observe.startup's "distributed" phase
    # Timeouts from config.distributed; a missing peer, a busy port or no cluster for
    # --distributed=auto: one line (jtrain.multihost.start).
    start.start(config, fv.coordinator_address, fv.num_processes, fv.process_id,
                auto=fv.distributed == "auto")
    all_hosts = fv.all_hosts_log or bool(config.get("log", {}).get("all_hosts", False))
    if jax.process_index() != 0 and not all_hosts:
        _quiet()
    from jtrain.observe import startup

    startup.mark("distributed", time.perf_counter() - t_distributed)  # + backend start

    result = run_from_cli(config, fv.workdir)  # like train(), with CLI hints
    if jax.process_index() == 0:  # the machine-readable result: one JSON line on stdout
        scalars = {k: v for k, v in result.summary.items()
                   if isinstance(v, (int, float, str, bool)) or v is None}
        sys.stdout.write(redact_text(json.dumps({"workdir": fv.workdir, **scalars},
                                                default=str)) + "\n")
        sys.stdout.flush()
    stopped = result.summary.get("stopped_by") in ("SIGTERM", "SIGINT")
    code = fv.stopped_exit_code if stopped else 0
    # Peers that are still saving do not take this for a dead peer: a stop is no failure
    # (every process stops at the same step), so the store says 0 whatever the exit code;
    # process 0 leaves last when it exits at once (os._exit) instead of at the barrier.
    monitor.finished(0, linger_s=EXIT_LINGER_S if code else 0.0)
    if code:
        _exit(code)


def _config_dict(fv) -> dict:
    """The config as a dict, with the flags that stand for config keys applied (a copy;
    train() resolves and validates it)."""
    config = fv.config.to_dict() if hasattr(fv.config, "to_dict") else dict(fv.config)
    if fv.strict_restore:
        config.setdefault("checkpoint", {})["strict_restore"] = True
    if fv.all_hosts_log:
        config.setdefault("log", {})["all_hosts"] = True
    if fv.verbosity is not None:
        config.setdefault("log", {})["verbosity"] = fv.verbosity
    if fv.debug_multihost and not config.get("distributed", {}).get("debug_every_steps"):
        config.setdefault("distributed", {})["debug_every_steps"] = DEBUG_MULTIHOST_EVERY
    return config


def _dry_run(fv) -> None:
    import jax

    if fv.dry_run_devices < 0:
        raise errors.ConfigError("--dry_run_devices", f"must be >= 0, got {fv.dry_run_devices}")
    if fv.dry_run_devices:  # fake CPU devices: only before JAX starts its backend
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", fv.dry_run_devices)
    from jtrain import dry_run

    dry_run.run(fv.config.to_dict() if hasattr(fv.config, "to_dict") else dict(fv.config))


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
    """Parse `argv` (argv[0] is the program) on fresh flags and run: what `python -m
    jtrain.main` and `jtrain train` do. User errors raise SystemExit(code) after
    printing their one line."""
    argv = list(argv)
    fv = flags.FlagValues()
    define_flags(fv, sys_argv=cli_lib.split_free_form(argv)[0])
    rest = parse_flags(argv, fv)
    cli_lib.mark_absl_parsed()
    main(rest, fv)


def _exit_now() -> None:
    """After the CLI's main, a fast exit: everything the run writes is closed and flushed
    by then (checkpoints waited for, writers and logs closed), and the interpreter's own
    teardown of JAX's backend and compiled programs took 1 s here on an idle machine
    (10 s under load) for nothing."""
    import logging

    if _multi_process():  # the shutdown barrier: process 0's coordination service must
        import jax  # outlive its peers' disconnect (as at a normal exit)

        jax.distributed.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)


def run():
    cli(sys.argv)
    _exit_now()


if __name__ == "__main__":
    run()
