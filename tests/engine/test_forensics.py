"""Run forensics in process: the on-device state digest (exact, order-free, position
sensitive), hashes.jsonl written by `jtrain.train` with the step's example indices,
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
