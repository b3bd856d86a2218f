"""Run forensics in process: the on-device state digest (exact, order-free, position
sensitive), hashes.jsonl written by `jtrain.train` with the step's example indices,
the indices in hashes.jsonl and skipped.jsonl being rows of the dataset passed (not of
the part left after data.val_fraction's hold-out), against numpy over `x[examples]`,
`jtrain.diff.diff_runs` on identical runs and on a run with one changed key (the key,
the first differing step, the leaf), `jtrain.replay.replay` reproducing a recorded step
bitwise and reporting a planted nondeterministic op (JTRAIN_FAULT=noise:N), and the
one-line errors (a step without a hash, a path that is not a run)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jtrain
from jtrain import diff as diff_lib
from jtrain import replay as replay_lib
from jtrain.errors import UsageError
from jtrain.observe import hashes
from projects import mydata
from projects.linen_classifier import Net  # features -> 8 -> 2 classes


def _data():  # 40 rows of 4 features, class 1 where the first is positive
    return mydata.make(40, train=None)


def _train(workdir, eval_data=None, **over):
    cfg = {"total_steps": 6, "seed": 0, "data": {"batch_size": 8},
           "eval": {"every_steps": 0}, "checkpoint": {"every_steps": 2, "max_to_keep": 5},
           "log": {"verbosity": 0, "writers": ("jsonl",)},
           "optim": {"name": "adamw", "lr": 0.05, "schedule": "constant"},
           "debug": {"hash_every_steps": 1}}
    for k, v in over.items():
        section, key = k.split("__")
        cfg[section] = {**cfg[section], key: v}
    return jtrain.train(cfg, str(workdir), model=Net(), train_data=_data(),
                        eval_data=eval_data)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("forensics")
    _train(root / "a")
    _train(root / "b")
    _train(root / "lr", optim__lr=0.02)
    return root


def test_digest_is_exact_and_sees_a_swap_of_two_elements():
    x = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
    swapped = x.at[0, 0].set(1.0).at[0, 1].set(0.0)
    tiny = x.at[2, 3].set(jnp.nextafter(x[2, 3], jnp.inf))
    layout = hashes.describe({"p": x})
    digest = [hashes.finish(np.asarray(hashes.make_digest()({"p": t})), layout)["hash"]
              for t in (x, x + 0, swapped, tiny)]
    assert digest[0] == digest[1] and len(set(digest)) == 3
    assert hashes.first_difference({"params/w": np.asarray(x)},
                                   {"params/w": np.asarray(tiny)})[0] == "params/w"
    assert hashes.first_difference({"a": np.ones(2)}, {"a": np.ones(2)}) is None


def test_hashes_jsonl_records_every_step_with_its_examples(runs):
    records = hashes.read(str(runs / "a"))
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert all(len(r["hash"]) == 64 and sorted(r["parts"]) == ["opt_state", "params", "rest"]
               for r in records)
    assert all(len(r["examples"]) == 8 and max(r["examples"]) < 40 for r in records)
    assert records == hashes.read(str(runs / "b"))  # the same run twice: bitwise


def test_diff_of_identical_runs_and_of_one_changed_key(runs):
    same = diff_lib.diff_runs(str(runs / "a"), str(runs / "b"))
    assert same["identical"] and same["hashes"]["compared"] == 6, same
    d = diff_lib.diff_runs(str(runs / "a"), str(runs / "lr"))
    assert not d["identical"]
    assert d["config"] == [{"key": "optim.lr", "a": 0.05, "b": 0.02}]
    assert d["hashes"]["first_step"] == 1 and d["hashes"]["first_examples_step"] is None
    assert d["leaf"]["step"] == 2 and d["leaf"]["path"].startswith("params/")
    assert d["leaf"]["max_abs_diff"] > 0
    assert any("optim.lr" in line for line in diff_lib.lines(d))
    json.dumps(d)  # the command's stdout line


def test_replay_reproduces_a_recorded_step_bitwise(runs):
    out = replay_lib.replay(str(runs / "a"), 5, model=Net(), train_data=_data())
    assert out["reproduced"] and out["from_step"] == 4 and out["examples_match"], out


def test_replay_of_a_run_given_its_own_eval_data(tmp_path):
    held_out = {k: v[40:] for k, v in mydata.make(56, train=None).items()}
    _train(tmp_path / "e", eval_data=held_out)
    out = replay_lib.replay(str(tmp_path / "e"), 5, model=Net(), train_data=_data(),
                            eval_data=held_out)
    assert out["reproduced"] and out["examples_match"], out


def test_replay_reports_a_planted_nondeterministic_op(tmp_path, monkeypatch):
    monkeypatch.setenv("JTRAIN_FAULT", "noise:3")
    _train(tmp_path / "n")
    monkeypatch.delenv("JTRAIN_FAULT")
    out = replay_lib.replay(str(tmp_path / "n"), 4, model=Net(), train_data=_data())
    assert not out["reproduced"] and out["from_step"] == 2 and out["examples_match"]
    assert out["leaf"].startswith("params/") and 0 < out["max_abs_diff"] < 1, out


def test_a_step_without_a_hash_and_a_path_that_is_not_a_run(runs, tmp_path):
    with pytest.raises(UsageError, match="recorded steps: 1, 2, 3, 4, 5, 6"):
        replay_lib.replay(str(runs / "a"), 9, model=Net(), train_data=_data())
    with pytest.raises(UsageError, match="not a jtrain run"):
        diff_lib.diff_runs(str(runs / "a"), str(tmp_path))
    with pytest.raises(UsageError, match="passed from Python"):
        replay_lib.replay(str(runs / "a"), 5)


def test_examples_are_rows_of_the_dataset_passed_when_part_is_held_out(tmp_path):
    """data.val_fraction holds 60 of 300 rows out; a NaN planted in row 251 is named as
    example 251, and every recorded step's loss and gradient norm are numpy's over
    x[examples] (learning rate 0: the fixed parameters below are the step's)."""
    r = np.random.default_rng(3)
    x = r.normal(size=(300, 3)).astype(np.float32)
    y = r.normal(size=(300, 2)).astype(np.float32)
    x[251, 1] = np.nan
    w = np.array([[0.5, -1.0], [2.0, 0.25], [-0.75, 1.5]], np.float32)
    b = np.array([0.1, -0.2], np.float32)
    model = (lambda rng, inputs: {"w": jnp.asarray(w), "b": jnp.asarray(b)},
             lambda params, inputs, rng=None, train=False:
             inputs["x"] @ params["w"] + params["b"])
    cfg = {"total_steps": 5, "seed": 0, "data": {"batch_size": 48, "val_fraction": 0.2},
           "eval": {"every_steps": 0}, "debug": {"hash_every_steps": 1},
           "log": {"every_steps": 1, "verbosity": 0, "writers": ("jsonl",)},
           "optim": {"name": "sgd", "lr": 0.0, "schedule": "constant"}}
    jtrain.train(cfg, str(tmp_path), model=model, train_data={"x": x, "targets": y},
                 loss_fn=lambda out, batch: jnp.mean((out - batch["targets"]) ** 2))
    skipped = [json.loads(line) for line in open(tmp_path / "skipped.jsonl")]
    assert [(e["reason"], e["examples"]) for e in skipped] == [("invalid batch", [251])]
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    train = {m["step"]: m for m in lines if "train/loss" in m}
    records = hashes.read(str(tmp_path))
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for rec in records:
        rows = np.asarray(rec["examples"])
        assert len(rows) == 48
        if rec["step"] == skipped[0]["step"]:
            assert 251 in rows
            continue
        err = (x[rows].astype(np.float64) @ w + b - y[rows])  # [48, 2]
        g = 2 * err / err.size
        norm = np.sqrt(np.sum((x[rows].T @ g) ** 2) + np.sum(g.sum(0) ** 2))
        np.testing.assert_allclose(train[rec["step"]]["train/loss"], np.mean(err ** 2),
                                   rtol=1e-5)
        np.testing.assert_allclose(train[rec["step"]]["train/grad_norm"], norm, rtol=1e-5)
    # five batches of 48 are the 240 kept rows once; the other 60 are the eval set
    seen = np.concatenate([r["examples"] for r in records])
    held = np.setdiff1d(np.arange(300), seen)
    assert len(set(seen.tolist())) == 240 and len(held) == 60
    final = [m for m in lines if "eval/loss" in m][-1]
    np.testing.assert_allclose(final["eval/loss"],
                               np.mean((x[held].astype(np.float64) @ w + b - y[held]) ** 2),
                               rtol=1e-5)


@pytest.mark.multidevice
def test_the_digest_of_a_sharded_array_is_that_of_the_global_array():
    """On 8 devices: the same values sharded over fsdp, over two axes, or on one device
    give one digest (integer sums, exact in any order)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = np.random.default_rng(0).normal(size=(16, 6)).astype(np.float32)
    state = {"params": {"w": x}, "step": np.int32(3)}
    want = hashes.state_digest(jax.device_put(state, jax.devices()[0]))
    for spec in (P("fsdp"), P("fsdp", "tensor"), P(None, "tensor")):
        sharded = {"params": {"w": jax.device_put(x, NamedSharding(mesh, spec))},
                   "step": jax.device_put(np.int32(3), NamedSharding(mesh, P()))}
        assert hashes.state_digest(sharded, mesh) == want, spec
