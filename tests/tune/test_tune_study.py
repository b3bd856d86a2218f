"""The study's bookkeeping on a real SQLite database, without training: a running trial
whose worker is gone (dead process on this host, or no heartbeat from another host) is
failed as interrupted and its parameters queued again with its workdir, exactly once
however many workers look; a trial asked past the last slot gives way; a storage that
cannot be opened is one line naming tune.storage, its password masked."""

import os
import socket
import subprocess
import sys
import time

import ml_collections
import optuna
import pytest

from jtrain import config as config_lib
from jtrain import tune
from jtrain.errors import ConfigError
from jtrain.tune import results
from jtrain.tune import study as study_lib

SPACE = {"optim.lr": ("log_uniform", 1e-4, 1e-1)}


def _tune_cfg(**kw) -> ml_collections.ConfigDict:
    return config_lib.resolve({"tune": {"space": SPACE, "trials": 2, **kw}}).tune


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _running(study, host, pid, beat):
    trial = study.ask()
    trial.suggest_float("optim.lr", 1e-4, 1e-1, log=True)
    trial.set_user_attr(study_lib.HOST, host)
    trial.set_user_attr(study_lib.PID, pid)
    trial.set_user_attr(study_lib.BEAT, beat)
    trial.set_user_attr(study_lib.WORKDIR, f"trials/{trial.number}")
    return trial


def test_gone_workers_trials_are_queued_again_once(tmp_path):
    cfg = _tune_cfg(stale_after_s=60.0)
    study = study_lib.open_study(cfg, str(tmp_path), SPACE)
    here, now = socket.gethostname(), time.time()
    dead = _running(study, here, _dead_pid(), now)  # killed on this host: at once
    alive = _running(study, here, os.getppid(), now)  # a live process: left alone
    remote_old = _running(study, "elsewhere", 1, now - 120)  # no heartbeat for 2 min
    remote_new = _running(study, "elsewhere", 1, now - 5)
    # Two workers look at once: each orphan is failed and queued by exactly one.
    again = study_lib.open_study(cfg, str(tmp_path), SPACE)
    got = study_lib.requeue_orphans(study, 60.0) + study_lib.requeue_orphans(again, 60.0)
    assert sorted(got) == [dead.number, remote_old.number]
    trials = study.get_trials()
    states = {t.number: t.state for t in trials}
    assert states[alive.number] == states[remote_new.number] == optuna.trial.TrialState.RUNNING
    waiting = [t for t in trials if t.state == optuna.trial.TrialState.WAITING]
    assert sorted(t.user_attrs[study_lib.CONTINUES] for t in waiting) == \
        [dead.number, remote_old.number]
    for t in waiting:  # same params, same workdir: the continuation resumes there
        first = trials[t.user_attrs[study_lib.CONTINUES]]
        assert t.system_attrs["fixed_params"] == first.params
        assert t.user_attrs[study_lib.WORKDIR] == f"trials/{first.number}"
        assert study_lib.is_interrupted(first)
    # The next job is a continuation, whatever tune.trials says.
    trial = study_lib.next_trial(study, cfg)
    assert trial.user_attrs[study_lib.CONTINUES] in (dead.number, remote_old.number)
    assert trial.suggest_float("optim.lr", 1e-4, 1e-1, log=True) == \
        trials[trial.user_attrs[study_lib.CONTINUES]].params["optim.lr"]


def test_a_trial_asked_past_the_last_slot_gives_way(tmp_path, monkeypatch):
    cfg = _tune_cfg(trials=1)
    study = study_lib.open_study(cfg, str(tmp_path), SPACE)
    ask = study.ask

    def racing_ask(*a, **k):  # another worker asks between our check and our ask
        other = ask()
        study_lib.mark(other)
        other.set_user_attr(study_lib.PID, os.getppid())  # a live worker, not us
        monkeypatch.setattr(study, "ask", ask)
        return ask(*a, **k)

    monkeypatch.setattr(study, "ask", racing_ask)
    assert study_lib.next_trial(study, cfg) is None
    mine = study.get_trials()[1]
    assert mine.state == optuna.trial.TrialState.FAIL and mine.user_attrs[study_lib.SURPLUS]
    assert [r["number"] for r in results.records(study, SPACE)] == [0]


def test_a_study_made_with_another_space_is_refused(tmp_path):
    study_lib.open_study(_tune_cfg(), str(tmp_path), SPACE)
    other = {"optim.lr": ("uniform", 1e-4, 1e-1)}
    with pytest.raises(ConfigError, match="^tune.space: study .* another space"):
        study_lib.open_study(_tune_cfg(), str(tmp_path), other)


def test_a_storage_that_cannot_be_opened_is_one_line(tmp_path, capsys):
    cfg = tmp_path / "search.py"
    cfg.write_text("from jtrain.config import defaults\n\ndef get_config():\n"
                   "    c = defaults(model='mlp')\n"
                   "    c.tune.space = {'optim': {'lr': ('uniform', 0.01, 0.1)}}\n"
                   "    return c\n")
    code = tune.main([f"--config={cfg}", f"--workdir={tmp_path}/runs",
                      "--tune.storage=postgresql://me:secretpw@127.0.0.1:1/db"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("jtrain: config error: tune.storage: cannot open "
                          "'postgresql://<redacted>@127.0.0.1:1/db': ") and \
        len(err.splitlines()) == 1, err
    assert "secretpw" not in err


def test_the_database_password_comes_from_the_environment(monkeypatch, tmp_path):
    """tune.storage names the database without its password; JTRAIN_TUNE_DB_PASSWORD
    gives it (any character: SQLAlchemy's parser reads back the same password), and no
    message shows it, raw or %-escaped, even when the driver's own error quotes the URL."""
    from sqlalchemy.engine import make_url

    password = "p'@:/%#?&x!$()*+,;= 9"
    monkeypatch.setenv(study_lib.PASSWORD_ENV, password)
    seen = []

    def rdb(url, engine_kwargs):
        seen.append(url)
        raise RuntimeError(f"could not connect to {url}")

    monkeypatch.setattr(optuna.storages, "RDBStorage", rdb)
    cfg = _tune_cfg(storage="postgresql://svc@db.example:5432/app")
    with pytest.raises(ConfigError) as e:
        study_lib.open_study(cfg, str(tmp_path), SPACE)
    parsed = make_url(seen[0])
    assert (parsed.username, parsed.password, parsed.host, parsed.database) == (
        "svc", password, "db.example", "app")
    escaped = seen[0].split("://")[1].rsplit("@", 1)[0].split(":", 1)[1]
    assert str(e.value) == ("tune.storage: cannot open 'postgresql://<redacted>@db.example:"
                            "5432/app': could not connect to postgresql://svc:<redacted>"
                            "@db.example:5432/app")
    assert escaped != password and escaped in seen[0]
    # a password in the URL as well: one place only
    with pytest.raises(ConfigError, match=r"^tune.storage: postgresql://<redacted>@h/app "
                                          r"holds a password and JTRAIN_TUNE_DB_PASSWORD"):
        study_lib.open_study(_tune_cfg(storage="postgresql://svc:other@h/app"),
                             str(tmp_path), SPACE)
    monkeypatch.delenv(study_lib.PASSWORD_ENV)  # none set: the URL as given
    assert study_lib.with_password("postgresql://svc@h/app") == ("postgresql://svc@h/app", "")
