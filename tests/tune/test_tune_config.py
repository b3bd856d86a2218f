"""tune.* keys: a bad space entry is one line naming `tune.space.<key>` (exit 2 from the
command), dotted keys from Python nest, the command without optuna says so, failed
trials are recorded with their one-line reason and never stop the study, and a monitor
no trial produces ends the study with exit 2."""

import json

import pytest

from journey import copy_project
from jtrain import config as config_lib
from jtrain import tune
from jtrain.config import space as space_lib
from jtrain.tune import results, trial as trial_lib


@pytest.mark.parametrize("space, message", [
    ({"optim.lrr": ("uniform", 0, 1)}, 'tune.space.optim.lrr: not a config key; did you '
                                       'mean "optim.lr"?'),
    ({"optim.lr": ("uniform", 0, 20)}, "tune.space.optim.lr: must be <= 10.0, got 20"),
    ({"optim.lr": ("normal", 0, 1)}, "tune.space.optim.lr: expected (kind, ...)"),
    ({"optim.lr": ("log_uniform", 0, 1)}, "tune.space.optim.lr: log_uniform needs lo > 0"),
    ({"optim.lr": ("uniform", 1e-2, 1e-3)}, "tune.space.optim.lr: lo must be < hi"),
    ({"data.batch_size": ("uniform", 1, 4)}, "tune.space.data.batch_size: data.batch_size "
                                             "is an integer key: use int, log_int, choice"),
    ({"data.batch_size": ("choice", (16, 0))}, "tune.space.data.batch_size: must be >= 1"),
    ({"data.batch_size": ("choice", ())}, "tune.space.data.batch_size: expected ('choice'"),
    ({"optim": ("uniform", 0, 1)}, "tune.space.optim: optim is a section, not a value"),
    ({"optim.lr.x": ("uniform", 0, 1)}, "tune.space.optim.lr.x: optim.lr is a value"),
    ({"optim.name": ("choice", ("adamw", "sgdd"))}, "tune.space.optim.name: must be one of"),
    ({"tune.trials": ("int", 1, 4)}, "tune.space.tune.trials: tune.* keys cannot be searched"),
])
def test_a_bad_space_entry_names_its_key(space, message):
    with pytest.raises(config_lib.ConfigError) as e:
        config_lib.resolve({"tune": {"space": space}})
    assert str(e.value).startswith(message), str(e.value)


def test_dotted_and_nested_spaces_are_one_space():
    dotted = {"optim.lr": ("log_uniform", 1e-4, 1e-1), "model.kwargs.width": ("int", 4, 8),
              "data": {"batch_size": ("choice", (16, 32))}}
    cfg = config_lib.resolve({"model": {"name": "user", "factory": "m:f"},
                              "tune": {"space": dotted}})
    assert space_lib.flatten(cfg.tune.space.to_dict()) == {
        "optim.lr": ("log_uniform", 1e-4, 1e-1), "model.kwargs.width": ("int", 4, 8),
        "data.batch_size": ("choice", (16, 32))}


def test_trial_config_and_best_config_file(tmp_path):
    base = config_lib.resolve({"model": {"name": "mlp"}, "tune": {"space": {
        "optim.lr": ("uniform", 0.1, 0.2), "model.hidden": ("choice", ((8,), (4, 4)))}}}
    ).to_dict()
    params = trial_lib.decode(base["tune"]["space"],
                              {"optim.lr": 0.12345678912345678, "model.hidden": "(4, 4)"})
    assert params == {"optim.lr": 0.12345678912345678, "model.hidden": (4, 4)}
    rec = {"number": 3, "value": 0.5, "params": params, "workdir": "trials/3"}
    path = results.write_best_config(str(tmp_path), base, rec, "eval/loss")
    ns: dict = {}
    exec(open(path).read(), ns)
    got = ns["get_config"]()
    got.early_stop.stopping_threshold = 0.5  # None-able numbers stay overridable
    assert got.optim.lr == 0.12345678912345678 and tuple(got.model.hidden) == (4, 4)
    assert "tune" not in got  # a plain run's config
    want = trial_lib.trial_config(base, params, keep_tune=False)
    want["early_stop"]["stopping_threshold"] = 0.5
    assert config_lib.config_hash(config_lib.resolve(got)) == \
        config_lib.config_hash(config_lib.resolve(want))


def test_best_is_the_lowest_or_highest_complete_trial():
    recs = [{"number": 0, "state": "complete", "value": 2.0},
            {"number": 1, "state": "pruned", "value": 0.1},
            {"number": 2, "state": "complete", "value": 1.0},
            {"number": 3, "state": "complete", "value": 1.0}]
    assert results.best(recs, "min")["number"] == 2  # ties: the earlier trial
    assert results.best(recs, "max")["number"] == 0
    assert results.best(recs[1:2], "min") is None


CONFIG = '''
from jtrain.config import defaults

def get_config():
    config = defaults(model="mlp")
    config.update({{"model": {{"num_outputs": 2, "hidden": (4,)}},
                   "data": {{"source": "tabular:make", "batch_size": 8,
                            "kwargs": {{"n": 32, "features": 3, "eval_rows": 8, **{data}}}}},
                   "total_steps": 4, "eval": {{"every_steps": 2}}, "log": {{"writers": ("jsonl",)}},
                   "tune": {{"space": {space}, "trials": 2}}}})
    return config
'''


def _config_file(tmp_path, monkeypatch, space: str, data: str = "{}") -> str:
    copy_project(tmp_path, "tabular")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "search.py"
    path.write_text(CONFIG.format(data=data, space=space))
    return str(path)


def test_the_command_says_what_is_wrong_in_one_line(tmp_path, monkeypatch, capsys):
    bad = _config_file(tmp_path, monkeypatch, '{"optim": {"lrr": ("uniform", 0, 1)}}')
    assert tune.main([f"--config={bad}", f"--workdir={tmp_path}/runs"]) == 2
    err = capsys.readouterr().err
    assert err == ('jtrain: config error: tune.space.optim.lrr: not a config key; did you '
                   'mean "optim.lr"?\n')
    empty = _config_file(tmp_path, monkeypatch, "{}")
    assert tune.main([f"--config={empty}", f"--workdir={tmp_path}/runs"]) == 2
    assert capsys.readouterr().err.startswith("jtrain: config error: tune.space: empty")
    monkeypatch.setitem(__import__("sys").modules, "optuna", None)  # not installed
    assert tune.main([f"--config={empty}", f"--workdir={tmp_path}/runs"]) == 2
    assert capsys.readouterr().err == (
        "jtrain: usage error: jtrain.tune needs optuna, which is not installed: "
        "pip install 'jtrain[tune]'\n")
    assert not (tmp_path / "runs").exists()


def test_failed_trials_are_recorded_and_the_study_goes_on(tmp_path, monkeypatch, capsys):
    # Every sampled FSDP size needs more devices than the one there is: each trial is a
    # config error at start-up.
    path = _config_file(tmp_path, monkeypatch, '{"mesh": {"fsdp": ("int", 3, 5)}}')
    assert tune.main([f"--config={path}", f"--workdir={tmp_path}/runs"]) == 1
    recs = [json.loads(x) for x in open(tmp_path / "runs/trials.jsonl")]
    assert [r["state"] for r in recs] == ["failed", "failed"]
    for r in recs:
        assert r["reason"].startswith("jtrain: config error: mesh.fsdp: "), r["reason"]
    assert "no trial completed" in capsys.readouterr().out


def test_a_non_finite_halt_is_a_failed_trial(tmp_path, monkeypatch, capsys):
    overflow = "{'bad': tuple(range(32))}"  # every row's loss overflows
    path = _config_file(tmp_path, monkeypatch, '{"optim": {"lr": ("uniform", 0.01, 0.1)}}',
                        overflow)
    argv = [f"--config={path}", f"--workdir={tmp_path}/runs", "--config.tune.trials=1",
            "--config.nonfinite.policy=halt"]
    assert tune.main(argv) == 1
    (rec,) = [json.loads(x) for x in (tmp_path / "runs/trials.jsonl").read_text().splitlines()]
    assert rec["state"] == "failed" and rec["reason"].startswith(
        "jtrain: non-finite error: training halted at step 1: non-finite loss"), rec


def test_a_monitor_no_trial_produces_ends_the_study(tmp_path, monkeypatch, capsys):
    path = _config_file(tmp_path, monkeypatch, '{"optim": {"lr": ("uniform", 0.01, 0.1)}}')
    argv = [f"--config={path}", f"--workdir={tmp_path}/runs", "--config.tune.monitor=eval/f1"]
    assert tune.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("jtrain: config error: tune.monitor: 'eval/f1' is not a metric "
                          "this run produces"), err
    assert len(err.splitlines()) == 1


def test_the_example_search_config_is_valid():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "configs" / "tune.py"
    spec = importlib.util.spec_from_file_location("tune_example_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for variant in ("", "quick"):
        cfg = config_lib.resolve(module.get_config(variant))
        assert set(space_lib.flatten(cfg.tune.space)) == {
            "optim.lr", "optim.weight_decay", "data.batch_size"}
    with pytest.raises(ValueError, match="unknown variant"):
        module.get_config("full")
