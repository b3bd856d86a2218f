"""Early stopping and ReduceLROnPlateau as state machines: scripted eval sequences give
exactly the specified stop step and factors, and a JSON round trip at any point (a
resume) changes nothing."""

import json
import math

import ml_collections
import pytest

from jtrain import config as config_lib
from jtrain.control import monitors


def section(name, **kw):
    cfg = config_lib.defaults("mlp")[name]
    cfg.update(kw)
    return ml_collections.ConfigDict(cfg.to_dict())


def run_early(cfg, values, resume_at=None):
    es = monitors.EarlyStopping(cfg)
    for i, v in enumerate(values):
        step = 10 * (i + 1)
        if resume_at == i:  # a kill between evals: the checkpointed state comes back
            es = monitors.EarlyStopping(cfg, json.loads(json.dumps(es.to_json())))
        reason = es.update(step, {"eval/loss": v})
        if reason:
            return step, reason, es
    return None, None, es


SEQ = [1.0, 0.8, 0.79, 0.85, 0.7, 0.71, 0.72, 0.73, 0.5]


@pytest.mark.parametrize("resume_at", [None, 2, 5, 7])
def test_early_stop_patience_and_min_delta(resume_at):
    cfg = section("early_stop", monitor="eval/loss", patience=3, min_delta=0.05)
    # improvements by > 0.05: 1.0 (first), 0.8, 0.7; then 0.71, 0.72, 0.73 -> stop at 80
    step, reason, es = run_early(cfg, SEQ, resume_at)
    assert step == 80 and "in 3 evals" in reason
    assert es.best.step == 50 and es.best.value == 0.7


@pytest.mark.parametrize("resume_at", [None, 1, 2, 3])
def test_a_gain_below_min_delta_moves_the_best_not_patience(resume_at):
    """0.79 beats 0.8 by less than min_delta: it is the best seen (what the summary
    reports), and patience still counts from 0.8's reference; a state saved without the
    reference (an older checkpoint) resumes with its value as the reference."""
    cfg = section("early_stop", monitor="eval/loss", patience=3, min_delta=0.05)
    values = [1.0, 0.8, 0.79, 0.85, 0.78, 0.77]
    step, reason, es = run_early(cfg, values, resume_at)
    assert step == 50 and "in 3 evals" in reason   # 0.79, 0.85, 0.78: none beats 0.8 - 0.05
    assert (es.best.step, es.best.value) == (50, 0.78)
    assert es.best.reference == 0.8
    assert (es.best.step, es.best.value) == min(
        ((10 * (i + 1), v) for i, v in enumerate(values[:5])), key=lambda sv: sv[1])
    old = {"best": {"value": 0.8, "step": 20, "bad_evals": 1}}
    resumed = monitors.EarlyStopping(cfg, old)
    resumed.update(40, {"eval/loss": 0.76})          # 0.8 - 0.76 < 0.05: no improvement
    assert (resumed.best.step, resumed.best.bad_evals) == (40, 2)


def test_early_stop_thresholds_and_non_finite():
    cfg = section("early_stop", monitor="eval/loss", patience=99, stopping_threshold=0.75)
    assert run_early(cfg, SEQ)[0] == 50
    cfg = section("early_stop", monitor="eval/loss", patience=99, divergence_threshold=0.9)
    assert run_early(cfg, [0.5, 0.6, 0.95, 0.1])[0] == 30
    cfg = section("early_stop", monitor="eval/loss", patience=99)
    step, reason, _ = run_early(cfg, [0.5, math.nan, 0.1])
    assert step == 20 and "nan" in reason
    cfg = section("early_stop", monitor="eval/loss", patience=99, check_finite=False)
    assert run_early(cfg, [0.5, math.nan, 0.1])[0] is None
    cfg = section("early_stop", monitor="eval/f1", mode="max", patience=2)
    es = monitors.EarlyStopping(cfg)
    assert [es.update(s, {"eval/f1": v}) is not None
            for s, v in ((1, 0.5), (2, 0.6), (3, 0.6), (4, 0.59))] == [False] * 3 + [True]


def test_unknown_metric_names_what_the_eval_has():
    es = monitors.EarlyStopping(section("early_stop", monitor="eval/nope"))
    with pytest.raises(KeyError, match="eval/nope .*eval/loss"):
        es.update(1, {"step": 1, "eval/loss": 1.0})


def run_plateau(cfg, values, resume_at=None, peak_lr=1.0):
    p = monitors.Plateau(cfg, peak_lr)
    factors = []
    for i, v in enumerate(values):
        if resume_at == i:
            p = monitors.Plateau(cfg, peak_lr, json.loads(json.dumps(p.to_json())))
        p.update(i + 1, {"eval/loss": v})
        factors.append(p.factor)
    return factors, p


@pytest.mark.parametrize("resume_at", [None, 1, 3, 4])
def test_plateau_patience_cooldown_min_lr(resume_at):
    cfg = section("plateau", monitor="eval/loss", factor=0.5, patience=1, cooldown=1,
                  min_lr=0.2, min_delta=0.0)
    # evals:  1.0  1.0  1.0 | cooldown 1.0 | 1.0  1.0 | cooldown 1.0  1.0  1.0
    values = [1.0] * 10
    factors, p = run_plateau(cfg, values, resume_at)
    # PyTorch's rule: reduce when bad evals > patience (2 bad evals), then skip
    # `cooldown` evals; the factor stops at min_lr / peak_lr = 0.2.
    assert factors == [1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.2, 0.2]
    assert [r[0] for r in p.reductions] == [3, 6, 9]


def test_plateau_improvement_resets():
    cfg = section("plateau", monitor="eval/loss", factor=0.1, patience=2, min_delta=0.01)
    factors, _ = run_plateau(cfg, [1.0, 0.9, 0.895, 0.89, 0.8, 0.8, 0.8, 0.8])
    assert factors == [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, pytest.approx(0.1)]
