"""Your own model from a config (`model.name="user"`, `model.factory`, `model.kwargs`), as a
user works: a temp cwd with their model, data and config modules, the CLI with relative
paths and no test helpers: train, override a kwarg, evaluate from the CLI, fine-tune with
init_from. A model passed from Python: the evaluate CLI says in one line how to evaluate
it, and `evaluate_checkpoint(workdir, model=...)` does."""

import json

import numpy as np
import pytest

import jtrain
from jtrain import evaluate
from jtrain.errors import ConfigError, EvaluateError
from journey import copy_project, run_python

CONFIG = '''
from jtrain.config import defaults

def get_config():
    config = defaults(model="user")
    config.update({"model": {"factory": "mymodels:make", "kwargs": {"hidden": 16}},
                   "data": {"source": "mydata:make", "batch_size": 16},
                   "total_steps": 12, "optim": {"lr": 0.01},
                   "eval": {"every_steps": 6}, "checkpoint": {"every_steps": 6}})
    return config
'''


def _run(cwd, module, *args):
    return run_python(cwd, "-m", module, *args)


@pytest.fixture
def user_dir(tmp_path):
    copy_project(tmp_path, "mymodels", "mydata")
    (tmp_path / "myconfig.py").write_text(CONFIG)
    return tmp_path


def test_cli_trains_evaluates_and_finetunes_a_factory_model(user_dir):
    proc = _run(user_dir, "jtrain.main", "--config=myconfig.py", "--workdir=runs/a")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "jtrain: model user Net (nnx), 114 params" in proc.stderr
    recorded = json.load(open(user_dir / "runs/a/config.json"))
    assert {k: recorded["model"][k] for k in ("name", "factory", "kwargs")} == {
        "name": "user", "factory": "mymodels:make", "kwargs": {"hidden": 16}}
    assert "model_source" not in recorded  # rebuildable from the config
    # a kwarg from the command line: another model size
    proc = _run(user_dir, "jtrain.main", "--config=myconfig.py", "--workdir=runs/b",
                "--config.model.kwargs={'hidden': 32}", "--config.total_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "jtrain: model user Net (nnx), 226 params" in proc.stderr
    # the evaluate CLI rebuilds the model from config.json
    # (the same numbers as the run's own final eval)
    proc = _run(user_dir, "jtrain.evaluate", "--workdir=runs/a", "--step=latest", "--no_plots")
    assert proc.returncode == 0, proc.stderr[-3000:]
    full = json.load(open(user_dir / "runs/a/eval_12.json"))
    report = full["metrics"]
    summary = json.load(open(user_dir / "runs/a/summary.json"))
    assert report["eval/accuracy"] == summary["eval/accuracy"]
    # the classification report (sklearn's layout) agrees with the metrics
    cr = full["classification_report"]
    assert abs(cr["accuracy"] - report["eval/accuracy"]) < 1e-9
    assert abs(cr["macro avg"]["f1-score"] - report["eval/f1_macro"]) < 1e-9
    assert cr["weighted avg"]["support"] == full["num_examples"]
    assert abs(report["eval/loss"] - summary["eval/loss"]) < 1e-6
    # fine-tune from it (a relative path), fresh step 0
    proc = _run(user_dir, "jtrain.main", "--config=myconfig.py", "--workdir=runs/ft",
                "--config.init.path=runs/a", "--config.total_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.load(open(user_dir / "runs/ft/summary.json"))["step"] == 2


@pytest.mark.slow  # seconds of CPU: the full suite runs it (tests/README.md)
def test_factory_gets_the_policy_dtype_and_bad_factories_are_config_errors(user_dir,
                                                                            monkeypatch):
    monkeypatch.syspath_prepend(str(user_dir))
    monkeypatch.chdir(user_dir)
    import mymodels

    cfg = {"model": {"name": "user", "factory": "mymodels:make", "dtype": "bfloat16"},
           "data": {"source": "mydata:make", "batch_size": 16}, "total_steps": 1,
           "eval": {"every_steps": 0}, "log": {"verbosity": 0}}
    jtrain.train(cfg, "runs/bf16")
    assert str(mymodels.seen[-1]) in ("bfloat16", "<class 'jax.numpy.bfloat16'>")
    for model, key in [({"name": "user"}, "model.factory"),
                       ({"name": "user", "factory": "nomodule_xyz:make"}, "model.factory"),
                       ({"name": "user", "factory": "mymodels:make",
                         "kwargs": {"width": 3}}, "model.kwargs")]:
        with pytest.raises(ConfigError) as e:
            jtrain.train({**cfg, "model": model}, "runs/bad")
        assert e.value.key == key


def test_python_model_run_evaluates_from_python_and_the_cli_says_how(user_dir, monkeypatch):
    monkeypatch.syspath_prepend(str(user_dir))
    monkeypatch.chdir(user_dir)
    import mydata
    import mymodels

    data = mydata.make()
    cfg = {"total_steps": 4, "data": {"batch_size": 16}, "log": {"verbosity": 0},
           "eval": {"every_steps": 0}}
    jtrain.train(cfg, "runs/py", model=mymodels.LinenNet(), train_data=data["train"],
                 eval_data=data["eval"])
    assert json.load(open("runs/py/run.json"))["model_source"] == "python: user LinenNet"
    proc = _run(user_dir, "jtrain.evaluate", "--workdir=runs/py")
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if " error: " in ln]
    assert len(lines) == 1 and "trained with a model passed from Python (user LinenNet)" \
        in lines[0] and "Traceback" not in proc.stderr
    with pytest.raises(EvaluateError):
        evaluate.evaluate_checkpoint("runs/py", plots=False)
    report = evaluate.evaluate_checkpoint("runs/py", model=mymodels.LinenNet(),
                                          data=data["eval"], plots=False)
    assert report["step"] == 4 and report["num_examples"] == 32
    assert np.isfinite(report["metrics"]["eval/loss"])
