"""best_config.py is fixed text plus data: strings from the study's database (params of
the space, the trial's workdir) and from the config sit in data literals, never in the
docstring or in code, so none can run when the file is loaded; secrets are masked, one
comment line naming each masked key."""

from __future__ import annotations

import ast
import os

import optuna
import pytest

from journey import copy_project
from jtrain import config as config_lib
from jtrain import errors, tune
from jtrain.tune import results
from jtrain.tune import study as study_lib
from jtrain.tune import trial as trial_lib

ESCAPE = 'x"""\nimport builtins; builtins.PWNED = 1\n"""'


def _write(tmp_path, params, workdir, kwargs):
    base = config_lib.resolve({"model": {"name": "mlp"}, "data": {"kwargs": kwargs},
                               "tune": {"space": {"optim.lr": ("uniform", 0.1, 0.2),
                                                  "data.kwargs.note": ("choice",
                                                                       (ESCAPE, "n"))}}}
                              ).to_dict()
    rec = {"number": 3, "value": float("nan"), "params": params, "workdir": workdir}
    return results.write_best_config(str(tmp_path), base, rec, "eval/loss")


def test_database_strings_never_reach_code(tmp_path):
    path = _write(tmp_path, {"optim.lr": 0.125, "data.kwargs.note": ESCAPE},
                  "trials/3", {"note": "n", "k\nimport os": "v"})
    text = open(path).read()
    tree = ast.parse(text)
    docstring = ast.get_docstring(tree)
    assert "PWNED" not in docstring and "trials/" not in docstring
    # the module is: a docstring, two imports, the masked-key comments, two assignments
    # of literals and get_config; nothing else runs at import
    kinds = [type(node).__name__ for node in tree.body]
    assert kinds == ["Expr", "ImportFrom", "Import", "Assign", "Assign", "FunctionDef"], kinds
    for node in tree.body[3:5]:  # data only: literals, and the names nan and inf
        for sub in ast.walk(node.value):
            assert isinstance(sub, (ast.Constant, ast.Dict, ast.List, ast.Tuple, ast.Load,
                                    ast.UnaryOp, ast.USub)) or (
                isinstance(sub, ast.Name) and sub.id in ("nan", "inf")), ast.dump(sub)
    ns: dict = {}
    exec(compile(text, path, "exec"), ns)
    import builtins
    assert not hasattr(builtins, "PWNED")
    assert ns["TRIAL"]["workdir"] == "trials/3"
    cfg = ns["get_config"]()
    assert cfg.data.kwargs.note == ESCAPE and cfg.optim.lr == 0.125
    assert ns["TRIAL"]["value"] != ns["TRIAL"]["value"]  # nan, written and read back


def test_secrets_are_masked_with_one_comment_line_each(tmp_path):
    path = _write(tmp_path, {"optim.lr": 0.125}, "trials/3",
                  {"password": "Hunter2pw", "uri": "postgres://u:Pg5ecret@db/x", "n": 4})
    text = open(path).read()
    assert "Hunter2pw" not in text and "Pg5ecret" not in text
    comments = [line for line in text.splitlines() if line.startswith("# masked: ")]
    assert [c.split("'")[1] for c in comments] == ["data.kwargs.password", "data.kwargs.uri"]
    ns: dict = {}
    exec(text, ns)
    cfg = ns["get_config"]()
    assert cfg.data.kwargs.password == "<redacted>" and cfg.data.kwargs.n == 4
    assert cfg.data.kwargs.uri == "postgres://<redacted>@db/x"


SEARCH = '''
from jtrain.config import defaults

def get_config():
    config = defaults(model="mlp")
    config.update({"model": {"num_outputs": 2, "hidden": (4,)},
                   "data": {"source": "tabular:make", "batch_size": 8,
                            "kwargs": {"n": 32, "features": 3, "eval_rows": 8}},
                   "total_steps": 4, "eval": {"every_steps": 2},
                   "tune": {"space": {"optim": {"lr": ("log_uniform", 1e-4, 1e-1)}},
                            "trials": 1}})
    return config
'''
LR = optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True)


def _crafted(name, value, dist):
    return optuna.trial.create_trial(params={"optim.lr": 0.01, name: value}, value=0.5,
                                     distributions={"optim.lr": LR, name: dist})


@pytest.mark.parametrize("trial, line", [
    (_crafted("step.factory", "subprocess:getoutput",
              optuna.distributions.CategoricalDistribution(["subprocess:getoutput"])),
     "params['step.factory']: not a key of tune.space"),
    (optuna.trial.create_trial(
        params={"optim.lr": "__import__('os').system('touch MARKER')"}, value=0.5,
        distributions={"optim.lr": optuna.distributions.CategoricalDistribution(
            ["__import__('os').system('touch MARKER')"])}),
     "params['optim.lr']: \"__import__('os').system('touch MARKER')\" is not a value of "
     "tune.space's ('log_uniform', 0.0001, 0.1)"),
    (optuna.trial.create_trial(params={"optim.lr": 5.0}, value=0.5, distributions={
        "optim.lr": optuna.distributions.FloatDistribution(1e-4, 10.0)}),
     "params['optim.lr']: 5.0 is not a value of tune.space's ('log_uniform', 0.0001, 0.1)"),
    ("waiting", "study trial workdir '../victim': not trials/<number>"),
], ids=["factory", "code-string", "out-of-range", "workdir"])
def test_a_crafted_study_database_is_refused_in_one_line(tmp_path, monkeypatch, capsys,
                                                         trial, line):
    """A study database written by someone else: a complete trial with keys outside
    tune.space (a factory and its command), a value written as a string that would be
    code, a value outside the range, or a queued continuation whose workdir leads out of
    the study. The search refuses it in one line (exit 2) before best_config.py is
    written or anything is trained; the command never runs."""
    copy_project(tmp_path, "tabular")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "search.py").write_text(SEARCH)
    (tmp_path / "runs").mkdir()
    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/runs/study.db",
                                study_name="runs", direction="minimize")
    if trial == "waiting":  # an interrupted trial 0 and its queued continuation
        study.add_trial(optuna.trial.create_trial(
            params={"optim.lr": 0.01}, distributions={"optim.lr": LR},
            state=optuna.trial.TrialState.FAIL))
        study.enqueue_trial({"optim.lr": 0.01}, user_attrs={
            study_lib.WORKDIR: "../victim", study_lib.CONTINUES: 0})
    else:
        study.add_trial(trial)
    code = tune.main(["--config=search.py", "--workdir=runs"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("jtrain: workdir error: ") and line in err, err
    assert not (tmp_path / "runs" / "best_config.py").exists()
    assert not (tmp_path / "MARKER").exists() and not (tmp_path / "victim").exists()
    assert not (tmp_path / "runs" / "trials").exists()


def test_a_trial_folder_is_built_from_its_number_and_kept_inside(tmp_path):
    root = tmp_path / "study"
    (root / "trials").mkdir(parents=True)
    (tmp_path / "victim").mkdir()
    assert trial_lib.trial_dir(str(root), "trials/7") == str(root / "trials" / "7")
    assert trial_lib.trial_dir("s3://b/s", "populations/2") == "s3://b/s/populations/2"
    os.symlink(tmp_path / "victim", root / "trials" / "3")  # a link out of the study
    for rel in ("trials/3", "../victim", "/tmp/x", "trials/3/../../x", "trials/x", "trials/07",
                3):
        with pytest.raises(errors.WorkdirError):
            trial_lib.trial_dir(str(root), rel)


@pytest.mark.parametrize("spec, good, bad", [
    (("choice", (16, 32)), [16, 32], [True, 16.0, "16", 64, None]),
    (("choice", ((4,), (8, 8))), [(4,), (8, 8)], ["(4,)", [4], (4, 4)]),
    (("int", 1, 4), [1, 4], [0, 5, 2.0, True, "2"]),
    (("uniform", 0.1, 0.2), [0.1, 0.15, 0.2], [0.09, float("nan"), float("inf"), True, "0.1"]),
])
def test_only_values_the_space_can_take_pass(spec, good, bad):
    space = {"model.x": spec}
    for value in good:
        assert trial_lib.checked_params(space, {"model.x": value}, "trial 0") == \
            {"model.x": value}
    for value in bad:
        with pytest.raises(errors.WorkdirError, match=r"^study trial 0: params\['model.x'\]: "):
            trial_lib.checked_params(space, {"model.x": value}, "trial 0")
