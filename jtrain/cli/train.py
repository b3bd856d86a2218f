"""The train command (`python -m jtrain.main`, `jtrain train`): its flags and what it does
with them, from the parsed flags to `engine.run.train_and_evaluate` (`jtrain.train`'s page).

    define_flags(fv, sys_argv)   the flags (`--config`, `--workdir`, multi-host, ...)
    run_log(fv)                  (workdir, verbosity): where library logs and tracebacks go
    main(fv, args, argv)         --print_config, --verify_resume, --dry_run, or the run;
                                 returns the exit code

Errors, exit codes and the way out are `cli.runner.run`'s, as for every command. Start-up order
of a run: the config resolved (a bad key fails here, before any peer is awaited), the
workdir checked, `multihost.start` (roll call, timeouts, peer heartbeat), processes other
than 0 quieted, then `engine.run.train_and_evaluate`.
"""

from __future__ import annotations

import json
import os
import sys

from absl import flags
from absl import logging as absl_logging
from ml_collections import config_flags

from jtrain import errors
from jtrain.cli import runner as cli

DEBUG_MULTIHOST_EVERY = 10

PROG = "python -m jtrain.main"
DESCRIPTION = """absl flags + ml_collections config files (`--config=configs/x.py:variant`,
`--config.optim.lr=3e-4`). Multi-host: pass --coordinator_address, --num_processes and
--process_id (or set JTRAIN_COORDINATOR, JTRAIN_NUM_PROCESSES, JTRAIN_PROCESS_ID), or
--distributed=auto on SLURM / Cloud TPU, where JAX finds its peers itself.

Every failure is one line on stderr and an exit code (docs/reference/exit_codes.md); its
traceback, and the logs of orbax, absl and grain, go to WORKDIR/train.log (on the
console too with --verbosity=2). A SIGTERM / SIGINT stops the run with its current step
saved, exit 0 (a signal during start-up: nothing new to save);
`--stopped_exit_code=N`: N instead (schedulers rerun it).
`--print_config` prints every key of the resolved config with its type, default, range
and description, and exits 0. stdout carries one JSON line, the run's result
(summary.json's scalars); everything else is on stderr.
`--verify_resume`: see jtrain.verify.resume (exit 1 on FAIL).
"""


def define_flags(fv: flags.FlagValues, sys_argv=None) -> None:
    # sys_argv: the argv that `--config.x.y=` overrides are read from (default sys.argv);
    # config_flags finds overrides there, not in the list the FlagValues is called with.
    config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/base.py:debug,"
                                    " or a packaged config by name, e.g. base:debug.",
                                    lock_config=True, flag_values=fv, sys_argv=sys_argv)
    flags.DEFINE_string("workdir", None, "The run's directory: checkpoints, logs, summary.",
                        flag_values=fv)
    flags.DEFINE_string("coordinator_address", os.environ.get("JTRAIN_COORDINATOR"),
                        "host:port of process 0, for multi-process runs.", flag_values=fv)
    flags.DEFINE_integer("num_processes", errors.env_int("JTRAIN_NUM_PROCESSES", 1),
                         "Number of processes in a multi-process run.", flag_values=fv)
    flags.DEFINE_integer("process_id", errors.env_int("JTRAIN_PROCESS_ID", 0),
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
                      "shard as asked (jtrain.engine.dry_run).", flag_values=fv)
    flags.DEFINE_integer("dry_run_devices", 0,
                         "--dry_run on this many fake CPU devices (e.g. 64 for a big "
                         "topology); 0 = the devices this machine has.", flag_values=fv)
    flags.DEFINE_bool("verify_negative_control", False,
                      "--verify_resume with the data position not restored, "
                      "--verify_topologies with determinism.topology_invariant off: "
                      "must FAIL.", flag_values=fv)
    flags.DEFINE_list("verify_topologies", [],
                      "Run the config on each of these fake CPU device counts (e.g. "
                      "2,4,8; in WORKDIR/devices_N) with determinism.topology_invariant "
                      "and compare hashes.jsonl and the evals step by step; exit 1 on a "
                      "mismatch.", flag_values=fv)
    flags.DEFINE_integer("verbosity", None, "0: errors and the result; 1: + header, progress"
                         " and evals (default); 2: + debug lines and the logs of orbax, absl "
                         "and grain on the console (= --config.log.verbosity=N).",
                         lower_bound=0, upper_bound=2, flag_values=fv)
    flags.DEFINE_bool("print_config", False, "Print every key of the resolved config (value,"
                      " type, default, range or choices, description) and exit 0; "
                      "--workdir not needed.", flag_values=fv)


def parse_flags(argv, fv: flags.FlagValues) -> list[str]:
    """`argv` (the program first) parsed into `fv` (flags from `define_flags(fv,
    sys_argv=argv)`); returns the program and the positional args; errors raise."""
    return [argv[0], *cli.parse_into(fv, argv[0], argv[1:])]


def run_log(fv) -> tuple[str, int] | None:
    """Library logs into WORKDIR/train.log unless verbosity 2 (jtrain.observe.liblogs).
    A workdir on an object store: on the console (its train.log is a staging copy's,
    made later, uploaded whole)."""
    from jtrain.checkpoint.store import is_remote

    if not fv.workdir or fv.print_config or is_remote(fv.workdir):
        return None
    verbosity = fv.verbosity
    if verbosity is None:
        log = getattr(fv.config, "log", None) if fv.config is not None else None
        verbosity = getattr(log, "verbosity", 1) if log is not None else 1
    return fv.workdir, int(verbosity)


def main(fv: flags.FlagValues, args: list[str], argv: list[str]) -> int:
    """The command, on parsed flags; `argv` as given (--verify_resume reruns it)."""
    if args:
        raise errors.UsageError(f"unexpected arguments: {' '.join(args)}")
    if fv.config is None:
        raise errors.ConfigError("--config", "required, e.g. --config=configs/base.py")
    if fv.print_config or fv.verify_resume or fv.verify_topologies or fv.dry_run:
        from jtrain import boot

        boot.resume_gc()  # the collector, paused through the imports
    if fv.print_config:
        from jtrain.config import reference

        sys.stdout.write(reference.resolved_text(_config_dict(fv)))
        sys.stdout.flush()
        return 0
    if not fv.workdir:
        raise errors.ConfigError("--workdir", "required (the run's directory)")
    # orbax and others log every save at INFO through absl; jtrain prints its own lines.
    absl_logging.set_verbosity(absl_logging.WARNING)
    if fv.verify_resume:
        from jtrain.checkpoint import store
        from jtrain.verify import resume

        local_dir = str(fv.config.get("checkpoint", {}).get("local_dir", "") or "")
        if store.is_remote(fv.workdir) and local_dir:
            raise errors.ConfigError("checkpoint.local_dir", "--verify_resume with a "
                                     "workdir on an object store is for runs without a "
                                     f"local tier; {fv.workdir} with local_dir={local_dir}")
        return resume.run_from_cli(["jtrain", *argv], fv.workdir, kills=fv.verify_kills,
                                   negative_control=fv.verify_negative_control,
                                   local_dir=local_dir)
    if fv.verify_topologies:
        from jtrain.verify import topologies

        counts = []
        for c in fv.verify_topologies:
            if not c.isascii() or not c.isdigit() or int(c) < 1:
                raise errors.ConfigError("--verify_topologies",
                                         f"device counts, e.g. 2,4,8; got {c!r}")
            counts.append(int(c))
        if len(counts) < 2:
            raise errors.ConfigError("--verify_topologies", "name two device counts or more")
        return topologies.run_from_cli(["jtrain", *argv], fv.workdir, counts,
                                       negative_control=fv.verify_negative_control)
    if fv.dry_run:
        _dry_run(fv)
        return 0
    config = _config_dict(fv)
    if ((config.get("determinism") or {}).get("gpu_ops") is True
            or config.get("deterministic") is True):  # (its old name) XLA_FLAGS before
        from jtrain import precision                 # the backend starts

        precision.set_deterministic(True)
    resolved = _start(fv, config)
    from jtrain.engine.run import train_and_evaluate

    result = train_and_evaluate(config, fv.workdir, resolved=resolved)  # = train()'s page
    _print_result(fv, result)
    stopped = result.summary.get("stopped_by") in ("SIGTERM", "SIGINT")
    return fv.stopped_exit_code if stopped else 0


def _start(fv, config: dict):
    """The run's start-up before its page: the one resolution (a bad key or value, or a
    unreachable s3:// workdir: one line before waiting for any peer), the workdir checked,
    `multihost.start` (timeouts from config.distributed; a missing peer, a busy port or
    no cluster for --distributed=auto: one line), processes other than 0 quieted.
    Returns the resolved config."""
    import time

    from jtrain import config as config_lib
    from jtrain.checkpoint.store import check_workdir

    # The run's one resolution and the workdir's check, before the engine's imports (a
    # second or more): a bad key, value or workdir is its one line at once.
    resolved = config_lib.resolve_for_run(config)
    check_workdir(fv.workdir)
    import jax

    import jtrain.engine.run  # noqa: F401 - imported here: the "imports" phase counts it
    from jtrain import boot
    from jtrain.multihost import start
    from jtrain.observe import startup

    startup.mark("imports", boot.since_start())  # flags, config file and imports
    boot.resume_gc()  # the collector, paused through the imports
    t_distributed = time.perf_counter()  # observe.startup's "distributed" phase
    start.start(config, fv.coordinator_address, fv.num_processes, fv.process_id,
                auto=fv.distributed == "auto")
    all_hosts = fv.all_hosts_log or bool(config.get("log", {}).get("all_hosts", False))
    if jax.process_index() != 0 and not all_hosts:
        _quiet()
    startup.mark("distributed", time.perf_counter() - t_distributed)  # + backend start
    return resolved


def _print_result(fv, result) -> None:
    """The machine-readable result: one JSON line on stdout (process 0)."""
    import jax

    from jtrain.redact import redact_text

    if jax.process_index() == 0:
        scalars = {k: v for k, v in result.summary.items()
                   if isinstance(v, (int, float, str, bool)) or v is None}
        sys.stdout.write(redact_text(json.dumps({"workdir": fv.workdir, **scalars},
                                                default=str)) + "\n")
        sys.stdout.flush()


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
    from jtrain.engine import dry_run

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
