"""A user's run-control rule (jtrain.control.Rule) in a run: it stops the run (summary.json
says why), scales the learning rate (the logged train/lr is the hand value from the next
step on), logs callback/* scalars, asks for a checkpoint (checkpoints/<step> exists);
its state survives a kill and a resume bitwise; named by path in a config it runs
through the CLI, and a foreign unsigned run naming one is refused by jtrain evaluate."""

import json
import os

import flax.linen as nn
import numpy as np
import pytest

import jtrain
from jtrain import cli
from jtrain.control import Action, Rule, faults, rule
from jtrain.errors import ConfigError, render
from jtrain.observe import trust
from journey import run_python, user_dir

LR = 0.05


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(3)(nn.relu(nn.Dense(16)(x)))


def arrays(n=96):
    r = np.random.default_rng(0)
    x = r.normal(size=(n, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0).astype(np.int32)
    return {"inputs": x, "targets": y}


CONFIG = {"total_steps": 16, "seed": 0,
          "optim": {"name": "sgd", "lr": LR, "schedule": "constant", "kwargs": {"momentum": 0.0}},
          "data": {"batch_size": 8, "shuffle": False, "val_fraction": 0.25},
          "eval": {"every_steps": 4, "metrics": ("loss",)},
          "log": {"every_steps": 1, "writers": ("jsonl",), "verbosity": 0},
          "checkpoint": {"every_steps": 0, "max_to_keep": 10, "keep_top_k": 0}}


class Probe(Rule):
    """Counts the steps it has seen (its state): at the 6th the learning rate x0.5; at
    step 5 a checkpoint; 2 x train/loss logged at each log step; a stop after the eval at
    step 12. A resume that lost the count would halve the rate later."""

    def __init__(self):
        self.seen = 0

    def after_step(self, step, metrics):
        self.seen += 1
        if self.seen == 6:
            return Action(lr_factor=0.5)
        return Action(checkpoint=True) if step == 5 else None

    def after_log(self, step, scalars):
        return Action(log={"double_loss": 2 * scalars["train/loss"]})

    def after_eval(self, step, eval_metrics):
        return Action(stop="enough at step 12") if step == 12 else None

    def state(self):
        return {"seen": self.seen}

    def restore(self, state):
        self.seen = state["seen"]


def run(workdir):
    return jtrain.train(CONFIG, str(workdir), model=Net(), train_data=arrays(),
                        callbacks=[Probe()])


def lines(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def record(workdir, step):
    with open(os.path.join(workdir, "checkpoints", str(step), "control", "metadata")) as f:
        return json.load(f)["monitors"]["callbacks"]


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("callbacks") / "ref"
    return workdir, run(workdir)


def test_callback_stops_scales_the_lr_logs_and_saves(ref):
    workdir, result = ref
    assert result.stopped_by == "callback" and result.summary["step"] == 12
    assert result.summary["stop_reason"] == "Probe: enough at step 12"
    assert sorted(int(s) for s in os.listdir(workdir / "checkpoints")) == [5, 12]
    rows = [r for r in lines(workdir) if "train/loss" in r]
    lr = {r["step"]: r["train/lr"] for r in rows}
    assert sorted(lr) == list(range(1, 13))
    # the 6th step seen asks for x0.5: from step 7 on, in float32 as the state holds it
    half = float(np.float32(LR) * np.float32(0.5))
    assert [lr[s] for s in range(1, 7)] == pytest.approx([LR] * 6, rel=1e-7)
    assert [lr[s] for s in range(7, 13)] == pytest.approx([half] * 6, rel=1e-7)
    assert result.summary["lr_factor"] == 0.5
    assert all(r["callback/double_loss"] == 2 * r["train/loss"] for r in rows)
    assert record(workdir, 12) == {"Probe": {"state": {"seen": 12}, "lr_scale": 0.5}}


def test_callback_state_survives_a_kill_and_resume_bitwise(ref, tmp_path, monkeypatch):
    workdir = tmp_path / "killed"
    monkeypatch.setenv(faults.FAULT_ENV, "step:4:TERM")
    assert run(workdir).stopped_by == "SIGTERM"
    monkeypatch.delenv(faults.FAULT_ENV)
    again = run(workdir)
    assert again.summary["resumed_from"] == 4 and again.summary["step"] == 12
    assert again.stopped_by == "callback"
    assert again.summary["state_sha256"] == ref[1].summary["state_sha256"]
    assert record(workdir, 12) == record(ref[0], 12)


def test_a_callback_s_mistakes_are_one_config_error_line(tmp_path, monkeypatch):
    class Bad(Rule):
        def after_step(self, step, metrics):
            return True

        def after_log(self, step, scalars):
            return Action(lr_factor=0.0)

    (bad,) = rule.users([Bad()])
    with pytest.raises(ConfigError) as e:
        bad.after_step(1, {})
    assert render(e.value) == ("jtrain: config error: control.callbacks: Bad.after_step "
                               "returned bool; expected jtrain.control.Action or None")
    with pytest.raises(ConfigError, match="Bad.after_log at step 3 asked for learning-rate "
                                          "factor 0.0; it must be finite and > 0"):
        bad.after_log(3, {})
    (tmp_path / "emptyrules.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as e:
        rule.users((), ["emptyrules:Nope"])
    assert render(e.value) == ("jtrain: config error: control.callbacks.0: 'emptyrules' has no "
                               "attribute 'Nope'")


RULE_PY = '''
from jtrain.control import Action, Rule


class StopAt(Rule):
    def after_log(self, step, scalars):
        return Action(log={"step_seen": step}, stop="step 3") if step == 3 else None
'''

CFG_PY = '''
from jtrain.config import defaults


def get_config():
    config = defaults(model="mlp")
    config.update({"model": {"num_outputs": 2, "hidden": (8,)},
                   "data": {"source": "jtrain.recipes.classify:make_data",
                            "batch_size": 16},
                   "total_steps": 8, "eval": {"every_steps": 0},
                   "log": {"every_steps": 1, "writers": ("jsonl",)},
                   "control": {"callbacks": ("myrule:StopAt",)}})
    return config
'''


def test_config_callback_through_the_cli_and_refused_unsigned(tmp_path, monkeypatch, capsys):
    cwd = user_dir(tmp_path, (), {"myrule.py": RULE_PY, "cfg.py": CFG_PY})
    proc = run_python(cwd, "-m", "jtrain.main", "--config=cfg.py", "--workdir=runs/x")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((cwd / "runs/x/summary.json").read_text())
    assert (summary["step"], summary["stopped_by"], summary["stop_reason"]) == (
        3, "callback", "StopAt: step 3")
    assert [r["callback/step_seen"] for r in lines(cwd / "runs/x")
            if "callback/step_seen" in r] == [3]
    # the same run from elsewhere (unsigned): jtrain evaluate refuses before importing it
    os.remove(cwd / "runs/x" / trust.SIGNATURE_FILE)
    monkeypatch.chdir(cwd)
    monkeypatch.syspath_prepend(str(cwd))
    assert cli.main(["evaluate", "--workdir=runs/x", "--no_plots"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "jtrain: workdir error: runs/x/config.json: names code that runs when it is opened: "
        "myrule:StopAt (control.callbacks.0); if you trust it: jtrain trust runs/x")
