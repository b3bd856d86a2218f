"""A run from elsewhere names code that jtrain defines but that is no model, data, loss
or step: a function that spawns a process, runs a command, writes, moves or deletes
files; or a module of the run itself without a ":" (python -m jtrain.recipes.report
imports it). Every command that opens a run refuses it in one line, exit 2, before
anything it names runs: the payload's marker file is never made and nothing outside
the run changes (the rule: jtrain/observe/trust.py, its list UNSIGNED)."""

import json
import os
import shutil

import pytest

import jtrain
from jtrain import cli
from jtrain.observe import trust

# Names only things a config may name unsigned: the built-in MLP, a recipe's data.
CFG = {"model": {"name": "mlp", "hidden": [4], "num_outputs": 2},
       "data": {"source": "jtrain.recipes.classify:make_data", "batch_size": 16},
       "total_steps": 2, "eval": {"every_steps": 0}, "checkpoint": {"every_steps": 2},
       "debug": {"hash_every_steps": 1}, "log": {"verbosity": 0}}

EVIL_PY = "open('MARKER', 'w').close()\n"
# (section, key edited, name, kwargs): each would make MARKER or remove victim/ if called.
PAYLOADS = [
    ("model", "factory", "jtrain.bench.scaling:_spawn",
     {"code": EVIL_PY, "devices": 1, "env": {}}),
    ("step", "factory", "jtrain.verify.resume:_run",
     {"argv": ["sh", "-c", "touch MARKER"], "env": {}, "log_path": "log.txt"}),
    ("model", "factory", "jtrain.bench.peers:launch",
     {"cmd": ["touch", "MARKER"], "cwd": ".", "log": "log.txt", "timeout": 30}),
    ("data", "source", "jtrain.bench.peers:_resolved",
     {"config_arg": "evil.py", "over": {}, "lm": False}),
    ("model", "factory", "jtrain.observe.layout:write_file",
     {"path": "MARKER", "content": "x"}),
    ("data", "source", "jtrain.checkpoint.integrity:remove_unfinished", {"path": "victim"}),
    ("data", "source", "jtrain.checkpoint.integrity:quarantine",
     {"path": "victim", "reason": "x"}),
    ("model", "factory", "runs.evil", {}),  # no ":": the run's own runs/evil/__init__.py
]


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("attacks")
    mp = pytest.MonkeyPatch()
    mp.chdir(root)
    jtrain.train(CFG, "runs/a")
    mp.undo()
    return root / "runs/a"


def _tree(root):
    """Every path under root outside runs/evil (the run), with its size."""
    return {os.path.relpath(os.path.join(d, f), root): os.path.getsize(os.path.join(d, f))
            for d, _, files in os.walk(root) if not d.startswith(str(root / "runs/evil"))
            for f in files}


def _plant(recipe_run, tmp_path, monkeypatch, section, key, name, kwargs):
    """runs/evil: the run copied, its config.json edited to name `name` (as anyone who
    can write a run directory could), unsigned; the payload's helpers beside it."""
    shutil.copytree(recipe_run, tmp_path / "runs/evil")
    os.remove(tmp_path / "runs/evil" / trust.SIGNATURE_FILE)
    path = tmp_path / "runs/evil/config.json"
    config = json.loads(path.read_text())
    if section == "model":
        config["model"] = {"name": "user", "factory": name, "kwargs": kwargs}
    else:
        config[section] = {**config.get(section, {}), key: name, "kwargs": kwargs}
    path.write_text(json.dumps(config, indent=2, sort_keys=True))
    (tmp_path / "runs/evil/__init__.py").write_text(EVIL_PY)
    (tmp_path / "runs/__init__.py").write_text("")
    (tmp_path / "evil.py").write_text(EVIL_PY)
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim/keep").write_text("x")
    (tmp_path / "runs/evil/summary.json").write_text(json.dumps({"step": 2}))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # python -m puts the cwd on sys.path


@pytest.mark.parametrize("section,key,name,kwargs", PAYLOADS,
                         ids=[p[2] for p in PAYLOADS])
def test_unsigned_run_naming_jtrain_internals_runs_nothing(recipe_run, tmp_path, monkeypatch,
                                                          capsys, section, key, name,
                                                          kwargs):
    import jtrain.evaluate
    from jtrain.recipes import report

    _plant(recipe_run, tmp_path, monkeypatch, section, key, name, kwargs)
    before = _tree(tmp_path)
    line = (f"jtrain: workdir error: runs/evil/config.json: names code that runs when it "
            f"is opened: {name} ({section}.{key}); if you trust it: jtrain trust runs/evil")
    commands = {
        "jtrain evaluate": lambda: cli.main(["evaluate", "--workdir=runs/evil", "--no_plots"]),
        "jtrain evaluate --follow": lambda: cli.main(["evaluate", "--follow", "runs/evil"]),
        "python -m jtrain.evaluate": lambda: jtrain.evaluate.main(["--workdir=runs/evil"]),
        "jtrain replay": lambda: cli.main(["replay", "runs/evil", "--step=2"]),
    }
    if section == "model":  # the report imports model.factory's module (its report())
        commands["python -m jtrain.recipes.report"] = lambda: report.main(["runs/evil"])
    for command, run in commands.items():
        code = run()
        err = capsys.readouterr().err.strip().splitlines()
        assert (code, err[-1:]) == (2, [line]), command
        assert not os.path.exists("MARKER"), command
        assert _tree(tmp_path) == before, command
