"""The Optuna study behind `python -m jtrain.tune`: its storage (an SQLite file in the
workdir, or any RDB URL several workers share), sampler and pruner, and which trial a
worker runs next. Only process 0 of a worker talks to it.

A worker's next job, in order: a trial waiting in the queue (a continuation of a killed
one), else a new trial while fewer than `tune.trials` were started. A trial whose worker
is gone (same host: its process no longer exists; any host: no heartbeat for
`tune.stale_after_s`) is marked failed *as interrupted* (an atomic state change: one
worker wins) and its parameters are queued again with its workdir, so its continuation
resumes from the trial's own last checkpoint. Interrupted trials do not count.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time

import optuna
from optuna.trial import TrialState

from jtrain import internals
from jtrain.errors import ConfigError, first_line
from jtrain.redact import redact_text

# Trial attributes (user attrs: visible in Optuna's own tools too).
HOST, PID, BEAT = "jtrain_host", "jtrain_pid", "jtrain_heartbeat"
WORKDIR, CONTINUES, RESUMED = "workdir", "continues", "resumed_from"
INTERRUPTED, SURPLUS, REASON, STEP = "interrupted", "surplus", "reason", "step"
STUDY_SPACE = "jtrain_space"
# A trial trained as a member of a population run (tune.population > 1, jtrain.tune.batch):
# its place in the batch and the batch's trials, in member order.
# MEMBER: its member in that run (trials that sampled the same values share one).
SLOT, BATCH, MEMBER = "population_slot", "population_batch", "member"


@dataclasses.dataclass
class Job:
    """What every process of a worker runs next (process 0 broadcasts it)."""
    number: int
    workdir: str  # relative to the tune workdir: trials/<n> (n: the first of its chain)
    params: dict  # dotted config key -> value
    continues: int | None = None
    resumed_from: int | None = None
    # A population batch (jtrain.tune.batch): one dict per member, in member order
    # (number, params, continues, resumed_from; number None = a member already told).
    members: list | None = None


# The database password, kept off command lines (every local user sees a process's
# argv; a launcher would copy it to every worker's): tune.storage names the database
# without it and each worker reads it from here.
PASSWORD_ENV = "JTRAIN_TUNE_DB_PASSWORD"


def storage_url(tune_cfg, workdir: str) -> str:
    return tune_cfg.storage or f"sqlite:///{os.path.join(workdir, 'study.db')}"


def with_password(url: str) -> tuple[str, str]:
    """(the URL to connect with, the password as written in it, "" for none): $PASSWORD_ENV
    put into a tune.storage URL that has none, %-escaped (SQLAlchemy's own URL)."""
    password = os.environ.get(PASSWORD_ENV, "")
    if not password or url.startswith("sqlite"):
        return url, ""
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
    except Exception as e:  # noqa: BLE001 - SQLAlchemy's parse error: the config's fault
        raise ConfigError("tune.storage", f"cannot parse {redact_text(url)!r}: "
                                          f"{redact_text(first_line(e))}") from None
    if parsed.password is not None:
        raise ConfigError("tune.storage", f"{redact_text(url)} holds a password and "
                                          f"{PASSWORD_ENV} is set: give it in one place, "
                                          f"{PASSWORD_ENV}")
    full = parsed.set(password=password).render_as_string(hide_password=False)
    return full, full.split("://", 1)[1].rsplit("@", 1)[0].split(":", 1)[1]


def open_study(tune_cfg, workdir: str, space: dict, name: str | None = None) -> optuna.Study:
    """Creates or joins the study; a study made with another space or objective is a
    ConfigError (its results would mix). Its name: tune.study_name, else `name`, else
    the workdir's last part."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    shown = redact_text(storage_url(tune_cfg, workdir))  # no password reaches a message
    url, escaped = with_password(storage_url(tune_cfg, workdir))
    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    for attempt in range(5):
        try:
            storage = optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
            break
        except Exception as e:  # noqa: BLE001 - a bad URL, an unreachable server, no driver
            # Workers starting together race to create the tables (a UNIQUE constraint
            # fails for all but one): the next attempt finds them.
            if attempt == 4 or "UNIQUE" not in str(e) and "already exists" not in str(e):
                why = redact_text(first_line(e))
                raise ConfigError("tune.storage", f"cannot open {shown!r}: " + (
                    why.replace(escaped, "<redacted>") if escaped else why)) from None
            time.sleep(0.5 + attempt)
    name = tune_cfg.study_name or name or os.path.basename(os.path.normpath(workdir))
    direction = "minimize" if tune_cfg.mode == "min" else "maximize"
    try:
        study = optuna.create_study(storage=storage, study_name=name, direction=direction,
                                    load_if_exists=True, pruner=make_pruner(tune_cfg))
    except ValueError as e:  # an existing study with the other direction
        raise ConfigError("tune.mode", f"study {name!r}: {first_line(e)}") from None
    mine = repr(sorted((k, repr(v)) for k, v in space.items())) + f" {tune_cfg.monitor}"
    theirs = study.user_attrs.get(STUDY_SPACE)
    if theirs is None:
        study.set_user_attr(STUDY_SPACE, mine)
    elif theirs != mine:
        raise ConfigError("tune.space", f"study {name!r} in {shown} was made with another "
                          "space or tune.monitor; use a new tune.study_name or workdir")
    return study


def make_sampler(tune_cfg, number: int):
    seed = tune_cfg.seed + number  # per trial: a rerun never repeats its random draws
    if tune_cfg.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def make_pruner(tune_cfg):
    if tune_cfg.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=tune_cfg.prune_startup_trials,
                                           n_warmup_steps=tune_cfg.prune_warmup_steps)
    if tune_cfg.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner()
    return optuna.pruners.NopPruner()


def is_interrupted(t) -> bool:
    return t.state == TrialState.FAIL and bool(t.user_attrs.get(INTERRUPTED))


def counted(trials) -> list:
    """Trials that use one of the study's `tune.trials` slots: first links of chains."""
    return [t for t in trials if CONTINUES not in t.user_attrs
            and not t.user_attrs.get(SURPLUS)]


def _orphaned(t, stale_after_s: float, now: float) -> bool:
    attrs = t.user_attrs
    if attrs.get(HOST) == socket.gethostname() and PID in attrs:
        if attrs[PID] == os.getpid():
            return True  # our pid in a former life (reused): we are not running it
        try:
            os.kill(attrs[PID], 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # alive, another user's
    beat = attrs.get(BEAT)
    if beat is None and t.datetime_start is not None:
        beat = t.datetime_start.timestamp()
    return beat is not None and now - beat > stale_after_s


def requeue_orphans(study: optuna.Study, stale_after_s: float) -> list[int]:
    """Running trials whose worker is gone: failed as interrupted, parameters queued
    again with their workdir. Returns their numbers."""
    now = time.time()
    return [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if _orphaned(t, stale_after_s, now) and interrupt(
                study, t, f"worker {t.user_attrs.get(HOST, '?')}:{t.user_attrs.get(PID, '?')}"
                " stopped")]


def interrupt(study: optuna.Study, t, why: str) -> bool:
    """Fails running trial `t` as interrupted and queues its continuation (same params,
    same workdir). False when another worker did it first."""
    first = t.user_attrs.get(WORKDIR, f"trials/{t.number}")
    storage, tid = internals.optuna_storage(study), internals.optuna_trial_id(study, t)
    try:
        storage.set_trial_user_attr(tid, INTERRUPTED, True)
        storage.set_trial_user_attr(tid, REASON, f"interrupted ({why}); continued in {first}")
        # The atomic step (a row lock in the RDB): only one worker fails a running trial.
        if not storage.set_trial_state_values(tid, TrialState.FAIL):
            return False
    except optuna.exceptions.UpdateFinishedTrialError:
        return False
    batch = {k: t.user_attrs[k] for k in (SLOT, BATCH) if k in t.user_attrs}
    study.enqueue_trial(dict(t.params), user_attrs={WORKDIR: first, CONTINUES: t.number,
                                                    **batch}, skip_if_exists=False)
    return True


def next_trial(study: optuna.Study, tune_cfg, requeue: bool = True):
    """The optuna Trial this worker runs next, or None when the study needs no more.
    `requeue=False` while this worker holds running trials (its own pid would look gone)."""
    if requeue:
        requeue_orphans(study, tune_cfg.stale_after_s)
    trials = study.get_trials(deepcopy=False)
    waiting = any(t.state == TrialState.WAITING for t in trials)
    if not waiting and len(counted(trials)) >= tune_cfg.trials:
        return None
    trial = study.ask()
    attrs = trial.user_attrs
    mark(trial)
    if CONTINUES not in attrs:
        # Two workers may ask at once past the last slot: the later number gives way.
        mine = [t.number for t in counted(study.get_trials(deepcopy=False))]
        if sorted(mine).index(trial.number) >= tune_cfg.trials:
            trial.set_user_attr(SURPLUS, True)
            trial.set_user_attr(REASON, "surplus: tune.trials were all started")
            study.tell(trial, state=TrialState.FAIL)
            return next_trial(study, tune_cfg, requeue)
    study.sampler = make_sampler(tune_cfg, trial.number)
    return trial


def mark(trial) -> None:
    """Who runs the trial, and a first heartbeat."""
    trial.set_user_attr(HOST, socket.gethostname())
    trial.set_user_attr(PID, os.getpid())
    trial.set_user_attr(BEAT, time.time())


def copy_reports(study: optuna.Study, trial, upto: int | None) -> None:
    """The interrupted trial's evals up to the restored step, for the pruner."""
    if upto is None:
        return
    storage = internals.optuna_storage(study)
    first = storage.get_trial(storage.get_trial_id_from_study_id_trial_number(
        internals.optuna_study_id(study), trial.user_attrs[CONTINUES]))
    for step, value in sorted(first.intermediate_values.items()):
        if step <= upto:
            trial.report(value, step)


class Heartbeat:
    """Beats `trial`'s heartbeat every `every` seconds in a thread while a trial runs."""

    def __init__(self, study: optuna.Study, trial, every: float):
        self._stop = threading.Event()
        self._storage, self._id = internals.optuna_storage(study), internals.optuna_trial_id(
            study, trial)
        self._every = every
        self._thread = threading.Thread(target=self._run, daemon=True, name="tune-heartbeat")

    def _run(self):
        while not self._stop.wait(self._every):
            try:
                self._storage.set_trial_user_attr(self._id, BEAT, time.time())
            except Exception:  # noqa: BLE001 - a busy database: the next beat retries
                pass

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
