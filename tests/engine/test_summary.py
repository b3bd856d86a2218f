"""The end of a run that skipped most of its updates: each skip is only a warning, so a run
can reach total_steps barely trained; with more than `nonfinite.max_skipped_share` of its
updates skipped it is not done: NonFiniteError (exit 4), summary.json says so, the
checkpoints stay, and a rerun judges it again (done with a higher share)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flax import nnx

import jtrain
from jtrain import errors
from jtrain.engine import summary


@pytest.mark.parametrize("step, skipped, share, fails", [
    (8, 4, 0.5, False),  # exactly the share: allowed
    (8, 5, 0.5, True),
    (100, 98, 0.5, True),
    (8, 8, 1.0, False),  # 1 = off
    (8, 0, 0.0, False),
    (8, 1, 0.0, True),  # 0 = any skipped update fails the run
    (0, 0, 0.5, False),
    (10, 3, 0.3, False),  # 0.3 * 10 rounds above 3: still allowed
])
def test_share_rule(step, skipped, share, fails):
    error = summary.skipped_share_error(step, skipped, share)
    assert (error is not None) == fails
    if fails:
        line = errors.render(error)
        assert line.startswith(f"jtrain: non-finite error: {skipped} of {step} updates were "
                               f"skipped ")
        assert f"nonfinite.max_skipped_share={share:g}" in line
        assert "WORKDIR/skipped.jsonl" in line and errors.exit_code(error) == 4


class Net(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x):
        return self.dense(x)


def _data(missing_every: int):
    """Regression rows; from row 8 on, every `missing_every`-th row has a NaN input."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [0.0]], np.float32))
    x[8::missing_every, 2] = np.nan  # the first batch is clean (checked before step 1)
    return {"inputs": x, "targets": y}


def _config(**nonfinite):
    return {"total_steps": 8, "data": {"batch_size": 8, "shuffle": False,
                                       "val_fraction": 0.0},
            "log": {"verbosity": 0}, "checkpoint": {"every_steps": 4},
            "nonfinite": nonfinite}


def test_a_run_that_skipped_most_updates_is_not_done(tmp_path):
    workdir = tmp_path / "run"
    with pytest.raises(errors.NonFiniteError) as caught:  # batches 2..8 hold a NaN row
        jtrain.train(_config(), workdir, model=Net(nnx.Rngs(0)), train_data=_data(2))
    line = errors.render(caught.value)
    assert line.startswith("jtrain: non-finite error: 7 of 8 updates were skipped (88%), "
                           "more than nonfinite.max_skipped_share=0.5: not done")
    stored = json.loads((workdir / "summary.json").read_text())
    assert (stored["stopped_by"], stored["exit_code"], stored["message"]) == (
        "max_skipped_share", 4, line)
    assert (stored["step"], stored["skipped_steps"]) == (8, 7)
    assert caught.value.summary == stored  # a script that catches it has the summary
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["4", "8"]
    assert len((workdir / "skipped.jsonl").read_text().splitlines()) == 7
    # The same call again: judged again (not "already finished"), nothing more trained.
    with pytest.raises(errors.NonFiniteError):
        jtrain.train(_config(), workdir, model=Net(nnx.Rngs(0)), train_data=_data(2))
    # A share the run is within: it ends done, from the same checkpoint.
    result = jtrain.train(_config(max_skipped_share=0.9), workdir, model=Net(nnx.Rngs(0)),
                          train_data=_data(2))
    assert result.stopped_by is None and result.summary["exit_code"] == 0
    assert result.summary["message"].startswith("jtrain: done at step 8")
    assert json.loads((workdir / "summary.json").read_text())["stopped_by"] is None


def test_a_run_below_the_share_ends_done(tmp_path):
    result = jtrain.train(_config(), tmp_path / "run", model=Net(nnx.Rngs(0)),
                          train_data=_data(24))  # 3 NaN rows: 3 of 8 updates skipped
    assert (result.summary["skipped_steps"], result.stopped_by) == (3, None)
    assert result.summary["message"].startswith("jtrain: done at step 8")


def test_best_is_the_best_eval_seen_whatever_min_delta(tmp_path):
    """early_stop.min_delta larger than any gain: after the first eval no eval counts as
    an improvement (patience alone reads min_delta), yet summary.json's best, the argmin
    of the recorded evals and `--step=best` name the same, lowest, eval."""
    from jtrain.engine import checkpoint_eval

    workdir = tmp_path / "run"
    cfg = {"total_steps": 12, "data": {"batch_size": 8, "shuffle": False, "val_fraction": 0.0},
           "log": {"verbosity": 0}, "eval": {"every_steps": 2},
           "checkpoint": {"every_steps": 2, "max_to_keep": 10},
           "early_stop": {"monitor": "eval/loss", "min_delta": 1e3, "patience": 100},
           "optim": {"lr": 0.05}}
    data = _data(64)
    data["inputs"][8, 2] = 0.0   # _data's one NaN row (every 64th from row 8) made finite
    eval_data = {k: v[:24] for k, v in data.items()}
    result = jtrain.train(cfg, workdir, model=Net(nnx.Rngs(0)), train_data=data,
                          eval_data=eval_data)
    evals = [(h["eval/loss"], h["step"]) for h in result.history]
    want_value, want_step = min(evals, key=lambda vs: (vs[0], -vs[1]))  # ties: newer
    assert want_step != evals[0][1], evals   # the loss went down: the first eval is not best
    stored = json.loads((workdir / "summary.json").read_text())
    assert (stored["best_step"], stored["best_value"]) == (want_step, want_value)
    steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir())
    assert want_step in steps
    assert checkpoint_eval.resolve_step("best", steps, str(workdir)) == want_step


def test_a_run_stopped_by_sigterm_is_not_judged_by_the_share(tmp_path, monkeypatch):
    """SIGTERM at step 4 with 3 of its 4 updates skipped (75% > 50%): a signal stop is a
    clean stop, exit 0, nothing judged; the rerun trains to the end and is judged then,
    over the 8 steps that ran (7 skipped)."""
    from jtrain.control import faults

    workdir = tmp_path / "run"
    monkeypatch.setenv(faults.FAULT_ENV, "step:4:TERM")
    stopped = jtrain.train(_config(), workdir, model=Net(nnx.Rngs(0)), train_data=_data(2))
    assert (stopped.stopped_by, stopped.summary["step"]) == ("SIGTERM", 4)
    assert stopped.summary["skipped_steps"] == 3    # over the share, yet a signal stop
    stored = json.loads((workdir / "summary.json").read_text())
    assert (stored["stopped_by"], stored["exit_code"]) == ("SIGTERM", 0)
    assert stored["message"].startswith("jtrain: stopped by SIGTERM at step 4")
    monkeypatch.delenv(faults.FAULT_ENV)
    with pytest.raises(errors.NonFiniteError) as caught:
        jtrain.train(_config(), workdir, model=Net(nnx.Rngs(0)), train_data=_data(2))
    assert errors.render(caught.value).startswith(
        "jtrain: non-finite error: 7 of 8 updates were skipped (88%)")
    assert caught.value.summary["resumed_from"] == 4
