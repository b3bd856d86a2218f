"""A model's state beyond parameters is carried by the train step: BatchNorm's running
statistics (NNX `nnx.BatchStat`, Linen's `batch_stats`) move with every applied update,
equal a numpy recomputation of the momentum average over the global batches the run
consumed, are what evaluation uses (its metrics equal the model evaluated by hand with
them), resume bitwise from a checkpoint, are exported beside the parameters and carried
by init.path; a skipped step leaves them, accumulation moves them once per
strided microbatch; under determinism.topology_invariant every eval row is scored and an
eval batch the chunks do not divide is refused before step 1."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from flax import linen as nn, nnx

import jtrain
from jtrain import state as state_lib
from jtrain.errors import ConfigError

MOMENTUM, EPS, BATCH, STEPS = 0.9, 1e-5, 32, 12


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.bn = nnx.BatchNorm(4, momentum=MOMENTUM, epsilon=EPS, rngs=rngs)
        self.fc = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.fc(self.bn(x))


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.BatchNorm(use_running_average=not train, momentum=MOMENTUM, epsilon=EPS,
                         name="bn")(x)
        return nn.Dense(2, name="fc")(x)


MODELS = {"nnx": lambda: NnxNet, "linen": lambda: LinenNet()}


def data(n=256, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(n, 4)) * [1.0, 2.0, 0.5, 3.0] + 5.0).astype(np.float32)
    return {"inputs": x, "targets": (x[:, 0] > 5.0).astype(np.int32)}


def config(total=STEPS, **over):
    cfg = {"seed": 0, "total_steps": total, "data": {"batch_size": BATCH},
           "optim": {"lr": 0.05},
           "eval": {"every_steps": total, "metrics": ["loss", "accuracy"]},
           "checkpoint": {"every_steps": 6}, "debug": {"hash_every_steps": 1},
           "log": {"writers": ("jsonl",)}}
    cfg.update(over)
    return cfg


def stats_of(kind, model_state):
    """(mean, var) of the one BatchNorm, as float64 numpy."""
    bn = model_state["bn"] if kind == "nnx" else model_state["batch_stats"]["bn"]
    return np.asarray(bn["mean"], np.float64), np.asarray(bn["var"], np.float64)


def numpy_stats(workdir, x):
    """The momentum average over the batches the run consumed, in its order (the
    examples each step read, from hashes.jsonl)."""
    with open(os.path.join(workdir, "hashes.jsonl")) as f:
        rows = sorted((json.loads(line) for line in f), key=lambda r: r["step"])
    mean, var = np.zeros(4), np.ones(4)
    for r in rows:
        b = x[r["examples"]].astype(np.float64)
        assert len(b) == BATCH
        mean = MOMENTUM * mean + (1 - MOMENTUM) * b.mean(0)
        var = MOMENTUM * var + (1 - MOMENTUM) * b.var(0)
    return mean, var


def by_hand(kind, state, ev):
    """Eval loss and accuracy of the trained params with the running statistics."""
    p = state.params
    mean, var = stats_of(kind, state.model_state)
    bn, fc = p["bn"], p["fc"]
    h = ((ev["inputs"] - mean) / np.sqrt(var + EPS) * np.asarray(bn["scale"])
         + np.asarray(bn["bias"]))
    logits = h @ np.asarray(fc["kernel"], np.float64) + np.asarray(fc["bias"])
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    y = ev["targets"]
    return -logp[np.arange(len(y)), y].mean(), (logits.argmax(1) == y).mean()


def check_statistics_and_eval(tmp_path, kind):
    """Train, then: the statistics equal numpy's momentum average, eval equals by hand."""
    train, ev = data(), data(100, seed=1)
    result = jtrain.train(config(), str(tmp_path), model=MODELS[kind](), train_data=train,
                          eval_data=ev)
    mean, var = stats_of(kind, result.state.model_state)
    want_mean, want_var = numpy_stats(tmp_path, train["inputs"])
    np.testing.assert_allclose(mean, want_mean, rtol=1e-5)
    np.testing.assert_allclose(var, want_var, rtol=1e-5)
    assert mean.min() > 3.0  # moved from its initial 0 towards the data's 5 (1 - 0.9**12)
    loss, accuracy = by_hand(kind, result.state, ev)
    got = result.history[-1]
    np.testing.assert_allclose(got["eval/loss"], loss, rtol=1e-5)
    assert got["eval/accuracy"] == accuracy


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_running_statistics_are_trained_and_used_by_eval(tmp_path, kind):
    check_statistics_and_eval(tmp_path, kind)


def test_resume_is_bitwise_and_the_export_holds_the_statistics(tmp_path):
    train, ev = data(), data(100, seed=1)
    straight = jtrain.train(config(), str(tmp_path / "a"), model=NnxNet, train_data=train,
                            eval_data=ev)
    first = jtrain.train(config(total=6, optim={"lr": 0.05, "decay_steps": STEPS}),
                         str(tmp_path / "b"), model=NnxNet, train_data=train, eval_data=ev)
    assert stats_of("nnx", first.state.model_state)[0].tolist() != [0.0] * 4
    resumed = jtrain.train(config(optim={"lr": 0.05, "decay_steps": STEPS}),
                           str(tmp_path / "b"), model=NnxNet, train_data=train,
                           eval_data=ev)
    assert state_lib.state_sha256(resumed.state) == state_lib.state_sha256(straight.state)
    a, b = (stats_of("nnx", r.state.model_state) for r in (straight, resumed))
    assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes()
    from jtrain.checkpoint import export as export_lib
    from safetensors.numpy import load_file

    record = export_lib.export(str(tmp_path / "a"), str(tmp_path / "out"))
    tensors = load_file(str(tmp_path / "out" / "params.safetensors"))
    np.testing.assert_array_equal(tensors["bn/mean"], a[0].astype(np.float32))
    assert record["model_state"] == ["bn/mean", "bn/var"]
    assert record["num_params"] == 4 + 4 + 4 * 2 + 2  # bn scale, bias; fc kernel, bias


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A trained run of each kind and its export: where init_from starts."""
    from jtrain.checkpoint import export as export_lib

    root = tmp_path_factory.mktemp("sources")
    out = {}
    for kind in MODELS:
        run = jtrain.train(config(total=6), str(root / kind), model=MODELS[kind](),
                           train_data=data())
        export_lib.export(str(root / kind), str(root / f"{kind}_export"))
        out[kind] = run.state, {"run": str(root / kind),
                                "export": str(root / f"{kind}_export")}
    return out


@pytest.mark.slow  # seconds of CPU: the full suite runs it (tests/README.md)
@pytest.mark.parametrize("kind", ["nnx", "linen"])
@pytest.mark.parametrize("source", ["run", "export"])
def test_init_from_carries_the_running_statistics(tmp_path, sources, kind, source):
    """A run started from a run or an export starts from the source's statistics: after
    one step at lr 0 they are the momentum update of the source's by the batch read, and
    eval (the source's params with them) equals the model evaluated by hand."""
    src_state, paths = sources[kind]
    ev = data(100, seed=1)
    cfg = config(total=1, optim={"lr": 0.0},
                 checkpoint={"every_steps": 0}, init={"path": paths[source]})
    result = jtrain.train(cfg, str(tmp_path), model=MODELS[kind](), train_data=data(),
                          eval_data=ev)
    with open(tmp_path / "hashes.jsonl") as f:
        (row,) = [json.loads(line) for line in f]
    batch = data()["inputs"][row["examples"]].astype(np.float64)
    src_mean, src_var = stats_of(kind, src_state.model_state)
    mean, var = stats_of(kind, result.state.model_state)
    np.testing.assert_allclose(mean, MOMENTUM * src_mean + (1 - MOMENTUM) * batch.mean(0),
                               rtol=1e-6)
    np.testing.assert_allclose(var, MOMENTUM * src_var + (1 - MOMENTUM) * batch.var(0),
                               rtol=1e-5)
    for a, b in zip(jax.tree.leaves(src_state.params), jax.tree.leaves(result.state.params),
                    strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    loss, accuracy = by_hand(kind, result.state, ev)
    np.testing.assert_allclose(result.history[-1]["eval/loss"], loss, rtol=1e-5)


def invariant_config(chunks=4, **eval_over):
    return config(total=1, optim={"lr": 0.0}, checkpoint={"every_steps": 0},
                  eval={"every_steps": 1, "metrics": ["loss", "accuracy"], **eval_over},
                  determinism={"topology_invariant": True, "chunks": chunks})


def test_topology_invariant_eval_scores_every_row(tmp_path):
    """Under the mode an eval set that is no multiple of the eval batch (20 rows in
    batches of 8) is scored whole: the last batch's padding is masked, every real row
    counted once, as the model evaluated by hand over all 20 rows."""
    ev = data(20, seed=1)
    result = jtrain.train(invariant_config(batch_size=8), str(tmp_path), model=NnxNet,
                          train_data=data(), eval_data=ev)
    loss, accuracy = by_hand("nnx", result.state, ev)
    np.testing.assert_allclose(result.history[-1]["eval/loss"], loss, rtol=1e-5)
    assert result.history[-1]["eval/accuracy"] == accuracy


def test_topology_invariant_refuses_an_eval_batch_the_chunks_do_not_divide(tmp_path):
    with pytest.raises(ConfigError) as e:
        jtrain.train(invariant_config(chunks=8, batch_size=12), str(tmp_path), model=NnxNet,
                     train_data=data(), eval_data=data(16, seed=1))
    assert str(e.value) == "determinism.chunks: 8 does not divide eval.batch_size=12"
    assert not (tmp_path / "hashes.jsonl").exists()  # refused before step 1


def momentum_stats(workdir, x, accum=1):
    """numpy's running statistics over the updates the run applied (the steps of the
    skip ledger, skipped.jsonl, leave them), moved once per microbatch:
    microbatch j of a batch is its rows j, j + accum, j + 2 accum, ..., in order j = 0, 1,
    ... (the documented layout)."""
    with open(os.path.join(workdir, "hashes.jsonl")) as f:
        rows = sorted((json.loads(line) for line in f), key=lambda r: r["step"])
    ledger = os.path.join(workdir, "skipped.jsonl")
    skipped = set()
    if os.path.exists(ledger):
        with open(ledger) as f:
            skipped = {json.loads(line)["step"] for line in f}
    mean, var = np.zeros(4), np.ones(4)
    for r in rows:
        if r["step"] in skipped:
            continue
        batch = x[r["examples"]].astype(np.float64)
        for j in range(accum):
            micro = batch[j::accum]
            mean = MOMENTUM * mean + (1 - MOMENTUM) * micro.mean(0)
            var = MOMENTUM * var + (1 - MOMENTUM) * micro.var(0)
    return mean, var, len(skipped)


def test_a_skipped_step_leaves_the_statistics_as_they_were(tmp_path):
    """A batch holding a non-finite row is skipped: its update is not applied and the
    running statistics stay as they were (not NaN from the row's NaN)."""
    train = data()
    train["inputs"][5, 1] = np.nan
    result = jtrain.train(config(), str(tmp_path), model=NnxNet, train_data=train,
                          eval_data=data(100, seed=1))
    mean, var = stats_of("nnx", result.state.model_state)
    want_mean, want_var, skipped = momentum_stats(tmp_path, train["inputs"])
    assert skipped >= 1 and int(result.state.skipped_steps) == skipped
    np.testing.assert_allclose(mean, want_mean, rtol=1e-5)
    np.testing.assert_allclose(var, want_var, rtol=1e-5)


def test_accumulation_moves_the_statistics_once_per_strided_microbatch(tmp_path):
    """optim.grad_accum_steps=4: the statistics move once per microbatch, in order, each
    microbatch the rows j, j + 4, ... of the batch (not consecutive quarters: numpy's
    recomputation with quarters differs), carried from one microbatch to the next."""
    train = data()
    result = jtrain.train(config(total=3, optim={"lr": 0.05, "grad_accum_steps": 4}),
                          str(tmp_path), model=NnxNet, train_data=train,
                          eval_data=data(100, seed=1))
    mean, var = stats_of("nnx", result.state.model_state)
    want_mean, want_var, _ = momentum_stats(tmp_path, train["inputs"], accum=4)
    np.testing.assert_allclose(mean, want_mean, rtol=1e-5)
    np.testing.assert_allclose(var, want_var, rtol=1e-5)
