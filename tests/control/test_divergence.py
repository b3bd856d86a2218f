"""The divergence warning (`log.divergence_warning`, jtrain.control.divergence): one
line, once per run, when a logged train loss window is more than the factor times the
run's first; results unchanged.

The journey: a user's script trains a tiny NNX regressor with SGD at lr 10 (its loss
grows about 1000x per log window) twice, with the warning on (the default) and off, and
checks the line (console, train.log, summary.json's `warnings`), exit 0, and that both
runs end in the same state.
"""

from __future__ import annotations

import json
import textwrap

from jtrain.control.divergence import Divergence
from journey import run_python


def test_warns_once_above_factor_times_the_first_window():
    d = Divergence(2.0)
    assert d.check(10, 4.0) is None  # the first window: the reference
    assert d.check(20, 7.9) is None  # below 2 x 4.0
    line = d.check(30, 9.0)
    assert line.startswith("jtrain: warning: step 30: the train loss (9, mean of the log "
                           "window) is 2.25x its first logged value (4 at step 10)"), line
    assert "log.divergence_warning=2, 0 = off" in line
    assert d.check(40, 100.0) is None and d.warnings == [line]  # once


def test_off_non_finite_and_non_positive_starts():
    assert Divergence(0.0).check(1, 1.0) is None and not Divergence(0.0).enabled
    off = Divergence(0.0)
    off.check(1, 1.0)
    assert off.check(2, 1e9) is None
    d = Divergence(2.0)
    assert d.check(1, float("nan")) is None and d.first is None  # a NaN window is no start
    d.check(2, -1.0)  # a loss that can be negative (an NLL): no ratio to compare
    assert d.check(3, 50.0) is None


def test_state_survives_a_resume():
    d = Divergence(2.0)
    d.check(5, 3.0)
    resumed = Divergence(2.0, json.loads(json.dumps(d.to_json())))
    assert resumed.first == (5, 3.0)
    assert resumed.check(10, 7.0) is not None
    again = Divergence(2.0, json.loads(json.dumps(resumed.to_json())))
    assert again.check(15, 70.0) is None and len(again.warnings) == 1  # warned already


SCRIPT = textwrap.dedent('''
    import json
    import numpy as np
    import jtrain
    from flax import nnx


    class Linear(nnx.Module):
        def __init__(self, rngs):
            self.out = nnx.Linear(4, 1, rngs=rngs)

        def __call__(self, x):
            return self.out(x)


    x = np.random.default_rng(0).normal(size=(256, 4)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True)
    shas = {}
    for factor in (None, 0.0):  # None: the default
        log = {"every_steps": 2} if factor is None else {"every_steps": 2,
                                                          "divergence_warning": factor}
        config = {"total_steps": 6, "seed": 0, "log": log,
                  "optim": {"name": "sgd", "lr": 10.0, "schedule": "constant",
                            "kwargs": {"momentum": 0.0}},
                  "data": {"batch_size": 32}, "eval": {"every_steps": 0},
                  "checkpoint": {"every_steps": 0}}
        result = jtrain.train(config, f"runs/{factor}", model=Linear,
                              train_data={"inputs": x, "targets": y})
        shas[str(factor)] = result.summary["state_sha256"]
    print(json.dumps(shas))
''')


def test_a_diverging_run_warns_once_and_trains_the_same(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    proc = run_python(tmp_path, "train.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    shas = json.loads(proc.stdout.strip().splitlines()[-1])
    assert shas["None"] == shas["0.0"]  # the warning changes nothing
    out = proc.stdout + proc.stderr
    warned = [ln for ln in out.splitlines() if "training is diverging" in ln]
    assert len(warned) == 1 and warned[0].startswith("jtrain: warning: step 4: "), out
    summary = json.loads((tmp_path / "runs/None/summary.json").read_text())
    assert summary["warnings"] == warned
    assert warned[0] in (tmp_path / "runs/None/train.log").read_text()
    assert json.loads((tmp_path / "runs/0.0/summary.json").read_text())["warnings"] == []


def test_decisions_restore_the_divergence_state_from_the_checkpoint_record():
    """Through what a checkpoint stores (the run-control record's monitors, as JSON):
    a resumed run decides as the uninterrupted one, and does not warn twice."""
    from types import SimpleNamespace

    from jtrain import config as config_lib
    from jtrain.control.decide import Decisions
    from jtrain.control.record import RunControl

    cfg = config_lib.resolve({"log": {"divergence_warning": 2.0}})
    losses = [(10, 4.0), (20, 5.0), (30, 9.0), (40, 20.0), (50, 30.0)]

    def decisions(record):
        said = []
        return Decisions(cfg, record, ledger=SimpleNamespace(), on_eval=None,
                         batch_of=lambda s: None, indices_of=lambda b: [],
                         say=said.append), said

    def record(**fields):
        return RunControl(config={}, config_sha256="", data_info={}, versions={}, **fields)

    whole, said_whole = decisions(record())
    for step, loss in losses:
        whole.after_log(step, {"train/loss_window": loss})
    for cut in (1, 3):  # before the warning, and after it
        first, said_first = decisions(record())
        for step, loss in losses[:cut]:
            first.after_log(step, {"train/loss_window": loss})
        saved = json.loads(json.dumps(record(monitors=first.state()).to_json()))
        resumed, said_resumed = decisions(RunControl.from_json(saved))
        for step, loss in losses[cut:]:
            resumed.after_log(step, {"train/loss_window": loss})
        assert said_first + said_resumed == said_whole, cut
        assert resumed.state()["divergence"] == whole.state()["divergence"]
    assert len(said_whole) == 1 and "step 30" in said_whole[0]
