"""The loop's run control, in process with a user's own Linen model on arrays: final
eval before the last save, retention exactly top-k ∪ latest ∪ every-N (also across
resumes), save_on_best, early stopping / plateau / on_eval end to end (identical after
a resume), the non-finite policy and the skip ledger, checks at start-up, and
metrics.jsonl without replayed steps."""

import json
import os

import flax.linen as nn
import jax
import numpy as np
import pytest

import jtrain
from jtrain import evaluate
from jtrain.control import faults
from jtrain.errors import ConfigError, NonFiniteError


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(3)(nn.relu(nn.Dense(16)(x)))


def arrays(n=64, bad_nan=(), bad_inf=(), seed=0):
    r = np.random.default_rng(seed)
    x = r.normal(size=(n, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0).astype(np.int32)
    x[list(bad_nan)] = np.nan
    x[list(bad_inf)] = 3e38  # finite input, overflowing loss
    return {"inputs": x, "targets": y}


def config(**over):
    cfg = {"total_steps": 16, "seed": 0,
           "optim": {"name": "sgd", "lr": 0.05, "schedule": "constant",
                     "kwargs": {"momentum": 0.0}},
           "data": {"batch_size": 8, "shuffle": False, "val_fraction": 0.25},
           "eval": {"every_steps": 4, "metrics": ("loss", "accuracy")},
           "log": {"every_steps": 1, "writers": ("jsonl",), "verbosity": 0},
           "checkpoint": {"every_steps": 0, "max_to_keep": 1, "keep_top_k": 0}}
    for key, value in over.items():
        section, _, name = key.partition("__")
        if name:
            cfg.setdefault(section, {})[name] = value
        else:
            cfg[section] = value
    return cfg


def kept(workdir):
    return sorted(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints")))


def control_record(workdir, step):
    with open(os.path.join(workdir, "checkpoints", str(step), "control", "metadata")) as f:
        return json.load(f)


def train(tmp_path, name="run", data=None, **over):
    return jtrain.train(config(**over), str(tmp_path / name), model=Net(),
                        train_data=data or arrays())


def sigterm_at(monkeypatch, step):
    monkeypatch.setenv(faults.FAULT_ENV, f"step:{step}:TERM")


def test_final_eval_is_in_the_final_checkpoint_and_the_top_k(tmp_path):
    # The case: keep_top_k=3, max_to_keep=1, eval and save every 4 of 16 steps,
    # loss falling: the top 3 are the last three, the final eval among them.
    res = train(tmp_path, total_steps=16, checkpoint__every_steps=4, checkpoint__keep_top_k=3,
                checkpoint__save_on_best=False)
    assert kept(tmp_path / "run") == [8, 12, 16]
    record = control_record(tmp_path / "run", 16)
    assert record["eval_history"][-1]["step"] == 16 and "16" in record["metric_registry"]
    assert [h["step"] for h in res.history] == [4, 8, 12, 16]
    assert res.summary["best_step"] == 16 and res.train_history[-1]["step"] == 16


def test_retention_is_top_k_union_latest_across_chunked_resumes(tmp_path, monkeypatch):
    # Training in chunks (total_steps raised each time; a constant schedule ignores it):
    # the best checkpoint survives, and every session ends with exactly top-1 ∪ latest.
    data = arrays()
    over = dict(checkpoint__keep_top_k=1, checkpoint__every_steps=0, eval__every_steps=2,
                optim__lr=0.5)  # a large lr: eval/loss goes up and down
    seen = {}
    for total in (4, 8, 12):
        res = train(tmp_path, data=data, total_steps=total, **over)
        seen.update({h["step"]: h["eval/loss"] for h in res.history})
        best = min(seen, key=lambda s: (seen[s], -s))
        assert kept(tmp_path / "run") == sorted({best, total}), (total, seen)
        # python -m jtrain.evaluate --step=best picks it (metrics.jsonl, resumes included)
        assert evaluate.resolve_step("best", kept(tmp_path / "run"),
                                     str(tmp_path / "run")) == best


def test_save_on_best_keeps_a_best_eval_between_saves(tmp_path):
    res = train(tmp_path, total_steps=12, eval__every_steps=2, checkpoint__every_steps=0,
                checkpoint__keep_top_k=1, optim__lr=0.5)
    values = {h["step"]: h["eval/loss"] for h in res.history}
    best = min(values, key=lambda s: (values[s], -s))
    assert kept(tmp_path / "run") == sorted({best, 12})
    assert res.summary["best_step"] == best


def test_early_stop_stops_at_the_same_step_after_a_resume(tmp_path, monkeypatch):
    over = dict(total_steps=40, eval__every_steps=2, optim__lr=1e-9,  # nothing improves
                early_stop__monitor="eval/loss", early_stop__patience=3,
                early_stop__min_delta=1e-3, checkpoint__every_steps=2)
    ref = train(tmp_path, "ref", **over)
    assert ref.summary["step"] == 8 and ref.stopped_by == "early_stop"
    assert "in 3 evals" in ref.summary["stop_reason"]
    # No eval improved by min_delta, but the best is the best seen (ties: the newer step).
    seen = {h["step"]: h["eval/loss"] for h in ref.history}
    assert ref.summary["best_step"] == min(seen, key=lambda s: (seen[s], -s))
    assert kept(tmp_path / "ref")[-1] == 8
    sigterm_at(monkeypatch, 5)  # between evals 4 and 6
    first = train(tmp_path, "resumed", **over)
    assert first.stopped_by == "SIGTERM" and first.summary["step"] == 5
    monkeypatch.delenv(faults.FAULT_ENV)
    again = train(tmp_path, "resumed", **over)
    assert again.summary["resumed_from"] == 5
    assert (again.summary["step"], again.stopped_by) == (8, "early_stop")
    assert again.summary["state_sha256"] == ref.summary["state_sha256"]


def test_plateau_factor_is_exact_in_the_state_and_the_logged_lr(tmp_path, monkeypatch):
    over = dict(total_steps=12, eval__every_steps=2, optim__lr=1e-9,
                plateau__monitor="eval/loss", plateau__patience=1, plateau__factor=0.5,
                plateau__min_delta=1e-3, checkpoint__every_steps=2)
    ref = train(tmp_path, "ref", **over)
    # evals at 2 (best), 4 (1 bad), 6 (2 bad > patience: x0.5), 8, 10 (x0.25), 12
    assert ref.summary["lr_factor"] == 0.25
    with open(tmp_path / "ref" / "metrics.jsonl") as f:
        lr = {r["step"]: r["train/lr"] for r in map(json.loads, f) if "train/lr" in r}
    assert lr[6] == pytest.approx(1e-9) and lr[7] == pytest.approx(0.5e-9)
    assert lr[11] == pytest.approx(0.25e-9)
    sigterm_at(monkeypatch, 7)
    train(tmp_path, "resumed", **over)
    monkeypatch.delenv(faults.FAULT_ENV)
    again = train(tmp_path, "resumed", **over)
    assert again.summary["lr_factor"] == 0.25
    assert again.summary["state_sha256"] == ref.summary["state_sha256"]
    with open(tmp_path / "resumed" / "metrics.jsonl") as f:
        steps = [r["step"] for r in map(json.loads, f) if "train/loss" in r]
    assert steps == sorted(set(steps)) == list(range(1, 13))  # no replayed duplicates


def test_on_eval_hook_stops_the_run_checkpointed(tmp_path):
    calls = []

    def on_eval(step, metrics):
        calls.append((step, sorted(metrics)))
        return step == 8

    res = jtrain.train(config(total_steps=16), str(tmp_path / "run"), model=Net(),
                       train_data=arrays(), on_eval=on_eval)
    assert [c[0] for c in calls] == [4, 8] and "eval/accuracy" in calls[0][1]
    assert res.summary["step"] == 8 and res.stopped_by == "on_eval"
    assert kept(tmp_path / "run") == [8]


def test_nonfinite_skips_are_exact_and_params_stay_finite(tmp_path):
    # shuffle off, batch 8, 48 train rows (val_fraction 0.25 takes 16): batch k = rows
    # [8k, 8k+8) of the train split. Bad: a NaN input (invalid batch) in batch 1, an
    # overflowing input (non-finite loss) in batches 3, 4 (2 in a row).
    data = arrays(n=64)
    train_rows = jtrain.data.as_data(data, "x")  # the split is a pure function of the seed
    del train_rows
    res = jtrain.train(config(total_steps=6, data__val_fraction=0.0, eval__every_steps=0),
                       str(tmp_path / "run"), model=Net(),
                       train_data=arrays(n=48, bad_nan=[9], bad_inf=[24, 25, 33]))
    ledger = [json.loads(line) for line in open(tmp_path / "run" / "skipped.jsonl")]
    assert [(e["step"], e["reason"]) for e in ledger] == [
        (2, "invalid batch"), (4, "non-finite loss"), (5, "non-finite loss")]
    assert ledger[0]["examples"] == [9] and ledger[1]["examples"] == list(range(24, 32))
    assert res.summary["skipped_steps"] == 3
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(res.state.params))
    assert int(res.state.consecutive_skips) == 0  # step 6 was applied normally


def test_nonfinite_halts_at_max_consecutive_and_under_halt(tmp_path):
    data = arrays(n=48, bad_inf=range(8, 48))  # every batch after the first is bad
    cfg = config(total_steps=12, data__val_fraction=0.0, eval__every_steps=0,
                 checkpoint__every_steps=1, nonfinite__max_consecutive=3)
    with pytest.raises(NonFiniteError, match="halted at step 4: .*3 in a row") as e:
        jtrain.train(cfg, str(tmp_path / "a"), model=Net(), train_data=data)
    assert e.value.exit_code == 4
    assert kept(tmp_path / "a") == [3]  # saves after the first bad step: finite params
    cfg["nonfinite"] = {"policy": "halt"}
    with pytest.raises(NonFiniteError, match="halted at step 2: .*policy=halt"):
        jtrain.train(cfg, str(tmp_path / "b"), model=Net(), train_data=data)


def _open_files_under(root) -> list[str]:
    """The files under `root` this process holds open (Linux: /proc/self/fd)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, already closed
            continue
        if target.startswith(str(root) + os.sep):
            found.append(target)
    return found


def test_a_halted_run_leaves_none_of_its_files_open(tmp_path):
    """A script or a search that goes on after a halt holds no file of the halted run:
    the error it caught (and its traceback's frames) keep nothing open."""
    data = arrays(n=48, bad_inf=range(8, 48))
    cfg = config(total_steps=12, data__val_fraction=0.0, eval__every_steps=0,
                 nonfinite__policy="halt")
    with pytest.raises(NonFiniteError) as e:
        jtrain.train(cfg, str(tmp_path / "a"), model=Net(), train_data=data)
    assert e.value.exit_code == 4 and e.traceback  # the frames are still alive here
    assert _open_files_under(tmp_path) == []


def test_skip_ledger_survives_a_resume_once(tmp_path, monkeypatch):
    cfg = config(total_steps=12, data__val_fraction=0.0, eval__every_steps=0,
                 checkpoint__every_steps=4)
    data = arrays(n=48, bad_nan=[3, 20, 41])
    ref = jtrain.train(cfg, str(tmp_path / "ref"), model=Net(), train_data=data)
    sigterm_at(monkeypatch, 8)  # bad rows 3, 20, 41: steps 1, 3, 6 and 7, 9, 12
    jtrain.train(cfg, str(tmp_path / "run"), model=Net(), train_data=data)
    monkeypatch.delenv(faults.FAULT_ENV)
    again = jtrain.train(cfg, str(tmp_path / "run"), model=Net(), train_data=data)
    read = lambda d: open(tmp_path / d / "skipped.jsonl").read()  # noqa: E731
    assert read("run") == read("ref") and len(read("ref").splitlines()) == 6
    assert again.summary["state_sha256"] == ref.summary["state_sha256"]
    assert [e["step"] for e in control_record(tmp_path / "run", 12)["skip_ledger"]] == [
        1, 3, 6, 7, 9, 12]


@pytest.mark.parametrize("over, key", [
    ({"early_stop__monitor": "eval/nonexistent"}, "early_stop.monitor"),
    ({"plateau__monitor": "eval/f1"}, "plateau.monitor"),
    ({"checkpoint__keep_top_k": 1, "checkpoint__monitor": "eval/los"}, "checkpoint.monitor"),
    ({"early_stop__monitor": "eval/loss", "eval__every_steps": 0}, "early_stop.monitor"),
    ({"optim__b1": 1.0, "optim__name": "adamw", "optim__kwargs": {}}, "optim.b1"),
    ({"spike__zscore": 4.0}, "spike.zscore"),  # no periodic checkpoint to roll back to
])
def test_bad_run_control_config_fails_before_the_first_step(tmp_path, over, key):
    with pytest.raises(ConfigError) as e:
        train(tmp_path, **over)
    assert e.value.key == key
    assert not (tmp_path / "run" / "checkpoints").exists() or not kept(tmp_path / "run")


def test_loss_spike_rolls_back_and_is_reproducible_across_kills(tmp_path, monkeypatch):
    # 192 rows, batch 8, no shuffle: step k reads rows [8(k-1), 8k), no batch twice in 24
    # steps. Rows of step 14 are scaled x300: a finite loss far above the others.
    data = arrays(n=192)
    data["inputs"][104:112] *= 300.0
    cfg = config(total_steps=24, data__val_fraction=0.0, eval__every_steps=0,
                 checkpoint__every_steps=5, checkpoint__max_to_keep=10,
                 spike={"zscore": 6.0, "window": 5, "lr_factor": 0.5})
    ref = jtrain.train(cfg, str(tmp_path / "ref"), model=Net(), train_data=data)
    summary = ref.summary
    assert summary["rollbacks"] == [[14, 10]]
    ledger = [json.loads(line) for line in open(tmp_path / "ref" / "skipped.jsonl")]
    undone = [e["step"] for e in ledger]
    assert undone[0] == 11 and undone == list(range(11, undone[-1] + 1)) and 14 in undone
    assert ledger[undone.index(14)]["examples"] == list(range(104, 112))
    assert summary["skipped_steps"] == len(undone) and summary["step"] == 24
    assert summary["lr_factor"] == 0.5
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(ref.state.params))
    # Without the rollback the x300 batch is applied.
    plain = jtrain.train(config(**{**{k: v for k, v in cfg.items() if k != "spike"}}),
                         str(tmp_path / "plain"), model=Net(), train_data=data)
    assert plain.summary["rollbacks"] == [] and \
        plain.summary["state_sha256"] != summary["state_sha256"]
    # Killed before the spike and after the rollback: resumed runs end identical.
    for kill_at in (12, 19):
        workdir = str(tmp_path / f"kill{kill_at}")
        sigterm_at(monkeypatch, kill_at)
        assert jtrain.train(cfg, workdir, model=Net(), train_data=data).summary[
            "stopped_by"] == "SIGTERM"
        monkeypatch.delenv(faults.FAULT_ENV)
        again = jtrain.train(cfg, workdir, model=Net(), train_data=data).summary
        assert again["state_sha256"] == summary["state_sha256"], kill_at
        assert again["rollbacks"] == [[14, 10]]
        assert open(os.path.join(workdir, "skipped.jsonl")).read() == \
            open(tmp_path / "ref" / "skipped.jsonl").read()


def test_loss_spike_after_max_rollbacks_halts_with_exit_4(tmp_path):
    data = arrays(n=192)
    data["inputs"][104:112] *= 300.0  # step 14
    data["inputs"][160:168] *= 300.0  # step 21
    cfg = config(total_steps=24, data__val_fraction=0.0, eval__every_steps=0,
                 checkpoint__every_steps=5, spike={"zscore": 6.0, "window": 5,
                                                   "max_rollbacks": 1})
    with pytest.raises(NonFiniteError, match="step 21: the train loss spiked again .* "
                                             "after 1 rollbacks") as e:
        jtrain.train(cfg, str(tmp_path / "run"), model=Net(), train_data=data)
    assert e.value.exit_code == 4
    assert max(kept(tmp_path / "run")) < 21  # the spiked trajectory was never saved
