"""eval.mode=async's internals, in process (the journey: tests/journeys/
test_async_eval_journey.py): which eval a step applies, the resumed run's metrics.jsonl,
a checkpoint deleted under the evaluator, the held checkpoints the keep policy keeps."""

import json
import types

from jtrain import config as config_lib
from jtrain.checkpoint import policy
from jtrain.engine import async_eval
from jtrain.observe import jsonl


def _cfg(every=5, lag=2, total=23):
    cfg = config_lib.defaults()
    cfg.eval.every_steps, cfg.eval.async_lag, cfg.total_steps = every, lag, total
    cfg.eval.mode = "async"
    return cfg


def _evals(cfg, history=()):
    ckpt = types.SimpleNamespace(control=types.SimpleNamespace(eval_history=list(history)),
                                 all_steps=lambda: [5, 10, 15], held=set(), directory="")
    return async_eval.AsyncEvals(cfg, "unused", ckpt)


def test_the_applied_eval_is_the_step_minus_the_lag_and_nothing_else():
    evals = _evals(_cfg())
    assert [evals.due(s) for s in (5, 10, 11, 15, 20, 23)] == [None, None, None, 5, 10, None]
    assert evals.ckpt.held == {5, 10, 15}  # a fresh run: every saved point waits
    resumed = _evals(_cfg(), history=[{"step": 5}])
    assert resumed.ckpt.held == {10, 15} and resumed.applied == 5
    resumed.saved(20), resumed.saved(21), resumed.saved(23)  # 23: the last step
    assert resumed.ckpt.held == {10, 15, 20, 23}


def test_the_keep_policy_keeps_held_checkpoints():
    owner = types.SimpleNamespace(
        cfg=types.SimpleNamespace(max_to_keep=1, keep_every_steps=0, keep_top_k=0,
                                  mode="min"),
        control=types.SimpleNamespace(metric_registry={}), held={10})
    infos = [types.SimpleNamespace(step=s) for s in (5, 10, 15)]
    assert policy.KeepPolicy(owner).should_preserve(infos, context=None) == [False, True, True]


def test_a_resume_drops_the_eval_records_it_applies_again(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 5, "train/loss": 1.0}, {"step": 5, "eval/loss": 2.0},
            {"step": 10, "train/loss": 0.5}, {"step": 10, "eval/loss": 1.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    jsonl.drop_evals_after(str(path), 5)
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:3]


def test_a_checkpoint_deleted_under_the_evaluator_is_reported_and_skipped(tmp_path):
    def gone(step, abstract):
        raise FileNotFoundError(step)

    lines = []
    opened = types.SimpleNamespace(
        cfg=None, reader=types.SimpleNamespace(directory=str(tmp_path), restore=gone),
        build=types.SimpleNamespace(abstract_with_shardings=lambda: None))
    record = async_eval._evaluate(opened, 7, lines.append)
    assert record == {"step": 7, "skipped": "deleted before it was evaluated (the run's "
                                            "checkpoint keep policy)"}
    assert lines == ["jtrain: warning: checkpoint 7 was deleted before it was evaluated "
                     "(the run's checkpoint keep policy); skipped"]


def test_async_mode_refuses_a_workdir_on_an_object_store():
    cfg = config_lib.resolve({"eval": {"mode": "async"}})
    async_eval.check(cfg)  # a local workdir, one process: fine
    try:
        async_eval.check(cfg, remote="s3://bucket/run")
    except config_lib.ConfigError as e:
        assert e.key == "eval.mode" and "s3://bucket/run" in str(e), e
    else:
        raise AssertionError("eval.mode=async with an s3:// workdir was not refused")
    async_eval.check(config_lib.resolve({}), remote="s3://bucket/run")  # sync: fine
