"""`python -m jtrain.tune --config=FILE --workdir=DIR [--tune.storage=URL]`: one worker of a
hyperparameter search. Start it N times (on N machines with a shared `tune.storage`) for
N workers; rerun it after a kill and it continues. Each trial is a jtrain run in
`DIR/trials/<n>` (DIR may be s3://bucket/prefix: jtrain.tune.bucket); see jtrain.tune for
the files it writes.

Several processes per trial (`JTRAIN_MODULE=jtrain.tune launch/local.sh N ...`, or
--coordinator_address / --num_processes / --process_id): process 0 alone talks to the
study and broadcasts each job to the others.
"""

from __future__ import annotations

import contextlib
import json
import os

from absl import flags
from ml_collections import config_flags

from jtrain.cli import runner as cli
from jtrain.errors import ConfigError, UsageError, WorkdirError

PROG = "python -m jtrain.tune"
DESCRIPTION = __doc__.split("\n\n", 1)[0]


def define_flags(fv: flags.FlagValues, sys_argv) -> None:
    config_flags.DEFINE_config_file("config", None, "Config file with tune.space, e.g. "
                                    "configs/x.py:debug.", lock_config=True, flag_values=fv,
                                    sys_argv=sys_argv)
    flags.DEFINE_string("workdir", None, "The search's directory (a path or "
                        "s3://bucket/prefix): study.db, trials/<n>, trials.jsonl, "
                        "best_config.py, tune.png.", flag_values=fv)
    flags.DEFINE_string("tune.storage", None, "Optuna RDB URL the workers share "
                        "(= --config.tune.storage), without its password (give that in "
                        "$JTRAIN_TUNE_DB_PASSWORD); default sqlite:///WORKDIR/study.db.",
                        flag_values=fv)
    flags.DEFINE_string("coordinator_address", os.environ.get("JTRAIN_COORDINATOR"),
                        "host:port of process 0, for multi-process trials.", flag_values=fv)
    flags.DEFINE_integer("num_processes", int(os.environ.get("JTRAIN_NUM_PROCESSES", "1")),
                         "Processes of each trial.", flag_values=fv)
    flags.DEFINE_integer("process_id", int(os.environ.get("JTRAIN_PROCESS_ID", "0")),
                         "This process's index.", flag_values=fv)


def _config(fv, argv) -> dict:
    if fv.config is None:
        raise ConfigError("--config", "required: a config file with tune.space")
    try:
        config = fv.config
        getattr(config, "lock", None)  # config_flags defers loading errors until here
    except Exception as e:  # noqa: BLE001 - what loading the file raised
        key, why = cli.describe_flag_error(e, argv)
        raise ConfigError(key, why) from None
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


def _share(job):
    """Process 0's job (a Job or None) on every process."""
    import jax

    from jtrain.tune.study import Job

    if jax.process_count() == 1:
        return job
    import numpy as np
    from jax.experimental import multihost_utils

    text = json.dumps(None if job is None else job.__dict__).encode()
    n = int(multihost_utils.broadcast_one_to_all(np.int32(len(text))))
    data = np.frombuffer(text, np.uint8).astype(np.int32) if jax.process_index() == 0 \
        else np.zeros(n, np.int32)
    data = np.asarray(multihost_utils.broadcast_one_to_all(data)).astype(np.uint8)
    shared = json.loads(data.tobytes().decode())
    return None if shared is None else Job(**shared)


def main(fv, args, argv) -> int:
    if args:
        raise UsageError(f"unexpected arguments: {' '.join(args)}")
    config = _config(fv, argv)
    if not fv.workdir:
        raise UsageError("--workdir: required (the search's directory)")
    if fv["tune.storage"].value is not None:
        config.setdefault("tune", {})["storage"] = fv["tune.storage"].value
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise UsageError("jtrain.tune needs optuna, which is not installed: "
                         "pip install 'jtrain[tune]'") from None
    from absl import logging as absl_logging

    from jtrain import boot
    from jtrain import config as config_lib
    from jtrain.config import space as space_lib
    from jtrain.observe import startup
    from jtrain.checkpoint import store
    from jtrain.checkpoint.store import check_workdir

    startup.mark("imports", boot.since_start())  # flags, config file and imports
    absl_logging.set_verbosity(absl_logging.WARNING)
    cfg = config_lib.resolve(config)
    if not space_lib.flatten(cfg.tune.space):
        raise ConfigError("tune.space", "empty: nothing to search; e.g. tune.space = "
                          "{'optim': {'lr': ('log_uniform', 1e-4, 1e-1)}}")
    remote = store.is_remote(fv.workdir)
    if remote and fv.num_processes > 1:
        raise WorkdirError(fv.workdir, "a search on an object store runs single-process "
                           "trials; use a mounted path (e.g. gcsfuse) for several processes")
    workdir = fv.workdir.rstrip("/") if remote else os.path.abspath(fv.workdir)
    check_workdir(workdir)  # s3://: the bucket reachable and readable, else one line
    # As for a run: the roll call, distributed.* timeouts, the peer heartbeat; a missing
    # peer or a busy port is one line (jtrain.multihost.start).
    from jtrain.multihost import start

    start.start(config, fv.coordinator_address, fv.num_processes, fv.process_id)
    if not remote:
        return Worker(cfg, workdir).run()
    from jtrain.tune import bucket

    with bucket.staged(workdir, cfg.tune, say=print) as files:
        return Worker(cfg, workdir, files).run()


class Worker:
    """Runs trials until the study needs no more (or a SIGTERM stops one). `files`: a
    search on an object store (jtrain.tune.bucket.StudyFiles): `workdir` is its URI,
    the study's files are in the staging copy `files.local`, uploaded at each change."""

    def __init__(self, cfg, workdir: str, files=None):
        import jax

        self.cfg, self.workdir, self.files = cfg, workdir, files
        self.local = workdir if files is None else files.local  # the study's files
        self.tune, self.base = cfg.tune, cfg.to_dict()
        self.space = self.base["tune"]["space"]
        self.primary = jax.process_index() == 0
        self.study = None
        self.batched = self.tune.population > 1
        if self.batched:
            from jtrain.tune import batch

            batch.check_base(self.base)
        if self.primary:
            from jtrain.tune import study as study_lib

            os.makedirs(self.local, exist_ok=True)
            self.study = study_lib.open_study(self.tune, self.local, _flat(self.space),
                                              name=_basename(workdir))
            if files is not None and files.leased:  # the lease: nobody runs its trials
                study_lib.requeue_orphans(self.study, 0.0)
            self._sync()

    def _sync(self) -> None:
        """A search on an object store: the study's changed files uploaded."""
        if self.files is not None:
            self.files.push()

    def say(self, line: str) -> None:
        if self.primary:
            print(line, flush=True)

    def run(self) -> int:
        if self.batched:
            self.say(f"jtrain: tune: tune.population={self.tune.population}: up to "
                     f"{self.tune.population} trials train as the members of one "
                     "population run; no trial is pruned (a member cannot stop alone: "
                     "every eval is still reported to the study); one worker per study")
        with self._signals_stop_between_trials():
            return self._loop()

    def _loop(self) -> int:
        from jtrain import boot
        from jtrain.multihost import preflight
        from jtrain.tune import trial as trial_lib

        while True:
            name = boot.take_early_signal()
            if name:  # between trials: nothing running to save
                self.say(f"jtrain: tune: {name} received: stopped before the next trial; "
                         "rerun the same command to continue")
                return 0
            if self.batched:
                trials, job = self._next_batch() if self.primary else (None, None)
            else:
                trial, job = self._next() if self.primary else (None, None)
                trials = [trial]
            job = _share(job)
            if job is None:
                break
            if self.primary:  # the trial asked (running, its workdir) is in the bucket
                self._sync()
            if job.members is not None:
                outcomes = self._run_batch(trials, job)
                if self.primary:
                    for t, outcome in zip(trials, outcomes, strict=True):
                        if t is not None:
                            self._finish(t, outcome)
                outcome = outcomes[0]
                if outcome.fatal is not None:
                    raise outcome.fatal
                if outcome.state == "interrupted":
                    self.say(f"jtrain: tune: stopped; the population in {job.workdir} saved "
                             f"at step {outcome.step}: rerun the same command to continue it")
                    return 0
                continue
            how = (f" (continues trial {job.continues}" + (
                f" from its step {job.resumed_from})" if job.resumed_from is not None
                else ", from scratch: it had no checkpoint)")) if job.continues is not None \
                else ""
            self.say(f"jtrain: tune: trial {job.number}{how} in {job.workdir}: "
                     + ", ".join(f"{k}={v!r}" for k, v in job.params.items()))
            report = None
            if self.primary:
                def report(step, value, trial=trial):
                    trial.report(value, step)
                    return trial.should_prune()
            with self._heartbeat(trial):
                outcome = trial_lib.run(self.base, job.params,
                                        trial_lib.trial_dir(self.workdir, job.workdir),
                                        self.tune.monitor, report)
            # Before the next job is shared: the next trial's start-up checks must not
            # read this trial's reports (jtrain.multihost.preflight).
            preflight.forget()
            if self.primary:
                self._finish(trial, outcome)
            else:  # in this process's log: the same trial, stopped at the same step
                import jax

                print(f"jtrain: tune: [process {jax.process_index()}] trial {job.number} "
                      f"{outcome.state} at step {outcome.step}: "
                      + ", ".join(f"{k}={v!r}" for k, v in job.params.items()), flush=True)
            if outcome.fatal is not None:
                raise outcome.fatal
            if outcome.state == "interrupted":
                self.say(f"jtrain: tune: stopped; trial {job.number} saved at step "
                         f"{outcome.step}: rerun the same command to continue it")
                return 0
        if self.primary and not self._final():
            return 1  # every trial failed: trials.jsonl says why
        return 0

    @contextlib.contextmanager
    def _signals_stop_between_trials(self):
        """SIGTERM / SIGINT between trials stop the worker (exit 0) instead of killing it;
        during a trial, train()'s own handler saves the step (a signal that came just
        before it is taken over the way the CLI's start-up signals are). With several
        processes SIGTERM is JAX's preemption notice and train() handles it."""
        import signal
        import threading

        import jax

        from jtrain import boot

        if jax.process_count() > 1 or threading.current_thread() is not \
                threading.main_thread():
            yield
            return
        previous = boot.record_signals_until_taken_over()
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _next(self):
        from jtrain.tune import study as study_lib
        from jtrain.tune import trial as trial_lib

        trial = study_lib.next_trial(self.study, self.tune)
        if trial is None:
            return None, None
        params = trial_lib.suggest(trial, self.space)
        attrs = trial.user_attrs
        rel = attrs.get(study_lib.WORKDIR) or f"trials/{trial.number}"
        trial.set_user_attr(study_lib.WORKDIR, rel)
        resumed = trial_lib.last_checkpoint(trial_lib.trial_dir(self.workdir, rel))
        if resumed is not None:
            trial.set_user_attr(study_lib.RESUMED, resumed)
        if study_lib.CONTINUES in attrs:
            study_lib.copy_reports(self.study, trial, resumed)
        return trial, study_lib.Job(trial.number, rel, params,
                                    attrs.get(study_lib.CONTINUES), resumed)

    def _next_batch(self):
        from jtrain.tune import batch

        return batch.next_batch(self.study, self.tune, self.space, self.workdir)

    def _run_batch(self, trials, job) -> list:
        from jtrain.multihost import preflight
        from jtrain.tune import batch
        from jtrain.tune import trial as trial_lib

        for slot, m in enumerate(job.members):
            if m["number"] is None:
                continue
            how = "" if m["continues"] is None else (
                f", continues trial {m['continues']}" + (
                    f" from its step {job.resumed_from}" if job.resumed_from is not None
                    else ", from scratch: it had no checkpoint"))
            self.say(f"jtrain: tune: trial {m['number']} (member {slot} of "
                     f"{len(job.members)}{how}) in {job.workdir}: "
                     + ", ".join(f"{k}={v!r}" for k, v in m["params"].items()))
        report = None
        if self.primary:
            def report(slot, step, value):
                if trials[slot] is not None:
                    trials[slot].report(value, step)
        with contextlib.ExitStack() as stack:
            for t in trials or ():
                stack.enter_context(self._heartbeat(t))
            outcomes = batch.run(self.base, job, trial_lib.trial_dir(self.workdir, job.workdir),
                                 self.tune.monitor, report)
        preflight.forget()
        return outcomes

    def _heartbeat(self, trial):
        if trial is None:
            return contextlib.nullcontext()
        from jtrain.tune import study as study_lib

        return study_lib.Heartbeat(self.study, trial, min(30.0, self.tune.stale_after_s / 4))

    def _finish(self, trial, outcome) -> None:
        from optuna.trial import TrialState

        from jtrain.tune import results
        from jtrain.tune import study as study_lib

        if outcome.step is not None:
            trial.set_user_attr(study_lib.STEP, outcome.step)
        if outcome.state == "interrupted":
            study_lib.interrupt(self.study, trial, outcome.reason)
        else:
            if outcome.reason:
                trial.set_user_attr(study_lib.REASON, outcome.reason)
            if outcome.state == "complete":
                self.study.tell(trial, outcome.value)
            else:
                self.study.tell(trial, state=TrialState.PRUNED if outcome.state == "pruned"
                                else TrialState.FAIL)
        recs = results.records(self.study, self.space)
        results.write_trials(self.local, recs)
        self._sync()
        best = results.best(recs, self.tune.mode)
        value = "" if outcome.value is None else f": {self.tune.monitor}={outcome.value:.6g}"
        why = f" ({outcome.reason})" if outcome.state == "failed" else ""
        self.say(f"jtrain: tune: trial {trial.number} {outcome.state} at step "
                 f"{outcome.step}{value}{why}" + (
                     f"; best so far: trial {best['number']} ({best['value']:.6g})"
                     if best else ""))

    def _final(self) -> bool:
        """Writes the results; False when no trial completed."""
        from jtrain.tune import results

        recs = results.records(self.study, self.space)
        results.write_trials(self.local, recs)
        counts = {s: sum(r["state"] == s for r in recs)
                  for s in ("complete", "pruned", "failed", "running", "waiting")}
        files = ["trials.jsonl"]
        best = results.best(recs, self.tune.mode)
        if best is not None:
            results.write_best_config(self.local, self.base, best, self.tune.monitor)
            files.append("best_config.py")
        if results.write_plot(self.local, self.study, recs, self.tune.monitor,
                              self.tune.mode):
            files.append("tune.png")
        self._sync()
        summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        self.say(f"jtrain: tune: {summary or 'no trials'}" + (
            f"; best trial {best['number']}: {self.tune.monitor}={best['value']:.6g} "
            f"({', '.join(f'{k}={v!r}' for k, v in best['params'].items())})"
            if best else "; no trial completed"))
        self.say(f"jtrain: tune: wrote {', '.join(files)} in {self.workdir}")
        return best is not None


def _basename(workdir: str) -> str:
    """The study's default name: the workdir's last part (of a path or a URI)."""
    return os.path.basename(os.path.normpath(workdir.split("://", 1)[-1]))


def _flat(space) -> dict:
    from jtrain.config import space as space_lib

    return space_lib.flatten(space)
