"""Every way in behaves the same: `python -m jtrain.CMD`, `python -m jtrain CMD` and the
`jtrain CMD` console script import the user's `model.factory` / `data.source` modules
from the current directory (where `python -m` puts them) for every command that rebuilds
a model: train, evaluate, export, replay, tune. Run as a user runs them: subprocesses
from a temp directory holding the user's modules and config, relative paths."""

import json
import os
import subprocess
import sys

import pytest

from journey import copy_project, user_env

CONFIG = '''
from jtrain.config import defaults


def get_config():
    config = defaults(model="user")
    config.update({"model": {"factory": "mymodels:make"},
                   "data": {"source": "mydata:make", "batch_size": 16},
                   "total_steps": 4, "eval": {"every_steps": 0},
                   "checkpoint": {"every_steps": 2}, "debug": {"hash_every_steps": 1},
                   "log": {"writers": ("jsonl",)},
                   "tune": {"space": {"optim": {"lr": ("log_uniform", 1e-3, 1e-1)}},
                            "trials": 1}})
    return config
'''

FORMS = {  # how each form spells command CMD
    "module": lambda cmd: [sys.executable, "-m",
                           {"train": "jtrain.main"}.get(cmd, f"jtrain.{cmd}")],
    "package": lambda cmd: [sys.executable, "-m", "jtrain", cmd],
    "script": lambda cmd: [os.path.join(os.path.dirname(sys.executable), "jtrain"), cmd],
}


def _run(cwd, form, cmd, *args):
    return subprocess.run([*FORMS[form](cmd), *args], cwd=cwd, env=user_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("project")
    copy_project(cwd, "mymodels", "mydata")
    (cwd / "cfg.py").write_text(CONFIG)
    return cwd


@pytest.fixture(scope="module")
def trained(project):
    """`train` in each form, once: runs/<form> (the console script's run also serves the
    export/replay test), and the process that trained it."""
    done = {}

    def train(form):
        if form not in done:
            done[form] = _run(project, form, "train", "--config=cfg.py", f"--workdir=runs/{form}")
        return done[form]
    return train


@pytest.mark.parametrize("form", sorted(FORMS))
def test_train_and_evaluate_import_the_users_modules_in_every_form(project, trained, form):
    run = f"runs/{form}"
    r = trained(form)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["step"] == 4
    r = _run(project, form, "evaluate", f"--workdir={run}", "--noplots")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "jtrain: eval of step 4" in r.stdout


def test_export_replay_tune_from_the_console_script(project, trained):
    """The console script's sys.path starts with its bin/ folder, not the cwd: these
    commands rebuild the user's model from config.json's module names all the same."""
    r = trained("script")
    assert r.returncode == 0, r.stderr[-2000:]
    r = _run(project, "script", "export", "--workdir=runs/script", "--out=exports/s")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (project / "exports/s/params.safetensors").exists()
    r = _run(project, "script", "replay", "runs/script", "--step=3")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["reproduced"] is True
    r = _run(project, "script", "tune", "--config=cfg.py", "--workdir=runs/t")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (project / "runs/t/best_config.py").exists()
