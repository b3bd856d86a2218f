"""The feature-interaction table (jtrain/config/interactions.py) kept true: the generated
cases cover every working pair; each case trains its features together three times
(uninterrupted, stopped by SIGTERM midway, resumed) and the resumed run ends bitwise
where the uninterrupted one did, with the same evals, which equal a hand evaluation of
the saved state where the case has an eval set of its own; each refused pair stops
before the first step with one line naming both keys. The 8-device cases:
test_interactions_multidevice.py; the page: docs/guide/feature-interactions.md."""

from __future__ import annotations

import contextlib
import os
from itertools import combinations
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import jtrain
from jtrain import errors, losses
from jtrain.config import interactions as table
from jtrain.control import faults
from jtrain.data import Mixture, tokens as tokens_lib
from jtrain.observe import plots
from jtrain.step import Step
from jtrain.tune.trial import trial_config

REPO = Path(__file__).resolve().parents[2]
VOCAB, BATCH, STEPS, STOP = 8, 16, 6, 4

# Crossings declared working whose generated cases are held back (none now): a pair
# goes here only while its fix is under way, never to hide a failure.
PENDING_FIXES: frozenset = frozenset()


class Net(nn.Module):
    """Rows [B, 4] (a Dense body) or tokens [B, T] (an embedding), an optional BatchNorm,
    a Dense head over VOCAB classes."""
    batchnorm: bool = False

    @nn.compact
    def __call__(self, x, train: bool = False):
        if isinstance(x, dict):  # packed windows: inputs, segment_ids, positions
            x = x["inputs"]
        if jnp.issubdtype(x.dtype, jnp.integer):
            h = nn.Embed(VOCAB, 8, name="embed")(x)  # [B, T, 8]
        else:
            h = nn.Dense(8, name="body")(x)  # [B, 8]
        if self.batchnorm:
            h = nn.BatchNorm(use_running_average=not train, momentum=0.9, name="bn")(h)
        return nn.Dense(VOCAB, name="head")(nn.relu(h))


def masked_nll(outputs, batch):
    """A loss of your own: summed cross-entropy and weight, padding rows weighted 0."""
    logp = jax.nn.log_softmax(outputs.astype(jnp.float32))
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    w = losses.weights_for(batch, nll.shape)
    return (nll * w).sum(), w.sum()


def own_step(batchnorm: bool) -> Step:
    """Plain SGD on the same Net, its BatchNorm statistics carried in the step's state."""
    net = Net(batchnorm)

    def init(rng, example):
        return dict(net.init(rng, example["inputs"]))

    def update(state, batch, rng, context):
        def loss(params):
            out, new = net.apply({**state, "params": params}, batch["inputs"], train=True,
                                 mutable=["batch_stats"] if batchnorm else [])
            total, weight = masked_nll(out, batch)
            return total / jnp.maximum(weight, 1.0), new

        (value, new), grad = jax.value_and_grad(loss, has_aux=True)(state["params"])
        params = jax.tree.map(lambda p, g: p - 0.1 * context.lr_factor * g,
                              state["params"], grad)
        return {**state, **new, "params": params}, {"loss": value}

    def evaluate(state, batch):
        return net.apply(state, batch["inputs"])

    return Step(init=init, update=update, evaluate=evaluate, name="sgd")


def rows(n, seed):
    r = np.random.default_rng(seed)
    x = r.normal(size=(n, 4)).astype(np.float32)
    return {"inputs": x, "targets": (x[:, 0] + x[:, 1] > 0).astype(np.int32)}


def documents(n, seed):
    r = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        start = int(r.integers(VOCAB))
        docs.append(((start + np.arange(int(r.integers(3, 10)))) % VOCAB).astype(np.int32))
    return docs


class _Ids:  # the documents are token ids already: shards written as jtrain tokenize does
    kind, vocab_size, eos, file, fingerprint = "ids", VOCAB, None, None, "ids"

    @staticmethod
    def encode(doc):
        return np.asarray(doc, np.uint32)


def token_shards(root: str, name: str, n: int, seed: int) -> str:
    """A folder of token shards (data.name=tokens) holding documents(n, seed)."""
    out = os.path.join(root, name)
    os.makedirs(out, exist_ok=True)
    tokens_lib.write_shards(_Ids(), documents(n, seed), out, shard_tokens=256)
    return out


def make_net(batchnorm: bool = False) -> Net:
    """model.factory for the cases a child evaluator rebuilds from config.json."""
    return Net(batchnorm)


def case_data(tokens: bool, n: int, held_out: bool):
    """data.source for those cases: the same train (and eval) data setup() makes."""
    make = documents if tokens else rows
    train = make(n, 0)
    return {"train": train, "eval": make(12 if tokens else 24, 1)} if held_out else train


def nested(settings: dict) -> dict:
    """Dotted keys -> a nested config: what a search does with its sampled values."""
    return trial_config({}, settings)


def merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) \
            and k not in ("lr_mults",) else v
    return out


BASE = {"seed": 0, "total_steps": STEPS, "data": {"batch_size": BATCH, "val_fraction": 0.0},
        "optim": {"lr": 0.01, "schedule": "constant"},
        "eval": {"every_steps": 3, "metrics": ["loss"]}, "checkpoint": {"every_steps": 3},
        "log": {"every_steps": 1, "writers": ["jsonl"], "verbosity": 0}}


def setup(case, root: str, workdir_root: str) -> dict:
    """jtrain.train's arguments for a case: the config with every feature's settings,
    the model, step, loss and data its features need."""
    on = set(case)
    settings: dict = {}
    for name in case:
        settings.update(table.feature(name).settings)
    if "two-tier checkpoints" in on:
        settings["checkpoint.local_dir"] = os.path.join(root, "local")
    shards = "token shards" in on
    tokens = "packing" in on or shards
    make = documents if tokens else rows
    n = 40 if tokens else 88 if "drop_last=False" in on else 96
    train, ev = make(n, 0), make(12 if tokens else 24, 1)
    if shards:  # data.name=tokens: the data is the config's, a quarter held out
        train = ev = None
        settings["data.path"] = token_shards(root, "shards", 160, 0)
        if "mixture" in on:
            settings.pop("data.path")
            settings["data.mixture"] = {
                c: {"source": "tokens", "weight": w,
                    "kwargs": {"path": token_shards(root, f"shards_{c}", k, s), "seq_len": 8}}
                for c, w, k, s in (("a", 0.7, 160, 0), ("b", 0.3, 80, 2))}
    elif "mixture" in on:
        train = Mixture({"a": train, "b": make(n // 2, 2)}, weights={"a": 0.7, "b": 0.3},
                        eval=None if "val_fraction" in on else {"a": ev, "b": make(10, 3)})
        ev = None
    if "val_fraction" in on:
        ev = None
    kwargs = dict(train_data=train, eval_data=ev,
                  loss_fn=masked_nll if "batch-scope loss" in on else None)
    if "own step" in on:
        kwargs["step"] = own_step("model state" in on)
    else:
        kwargs["model"] = Net("model state" in on)
    return {"config": merge(BASE, nested(settings)), "kwargs": kwargs,
            "workdir_root": workdir_root, "tokens": tokens, "eval_data": ev, "rows": n}


def by_path(given: dict, tokens: bool, n: int, batchnorm: bool) -> dict:
    """The settings naming setup()'s Python objects by import path (this module, on the
    child evaluator's PYTHONPATH): the same model, step, loss and data."""
    assert not isinstance(given["train_data"], Mixture)  # refused with async eval
    out: dict = {} if given["train_data"] is None else {  # None: token shards, by path
        "data.source": f"{__name__}:case_data",
        "data.kwargs": {"tokens": tokens, "n": n, "held_out": given["eval_data"] is not None}}
    if "step" in given:
        out.update({"step.factory": f"{__name__}:own_step",
                    "step.kwargs": {"batchnorm": batchnorm}})
    else:
        out.update({"model.name": "user", "model.factory": f"{__name__}:make_net",
                    "model.kwargs": {"batchnorm": batchnorm}})
    if given["loss_fn"] is not None:
        out["loss.fn"] = f"{__name__}:masked_nll"
    return out


def hand_eval(run, ev, case) -> float:
    """eval/loss of the saved state computed here: the Net applied to the state's
    params (and statistics), the mean cross-entropy in numpy (float64)."""
    state = run.state
    variables = dict(state.params) if "own step" in case else {
        "params": state.params, **dict(state.model_state or {})}
    logits = np.asarray(Net("model state" in case).apply(variables, ev["inputs"]), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                                                                           keepdims=True)) \
        - logits.max(-1, keepdims=True)
    return float(-logp[np.arange(len(ev["targets"])), ev["targets"]].mean())


def train_case(case, tmp_path, monkeypatch, workdir_root=None):
    """The case's three runs; returns (uninterrupted, resumed, setup)."""
    # A population's plot of every member's curves costs more CPU than its 6 steps and
    # is no part of any pair here (tests/engine/test_population.py checks it).
    monkeypatch.setattr(plots, "population_curves", lambda *a, **k: False)
    root = str(tmp_path)
    base = workdir_root or root
    s = setup(case, root, base)
    cfg = s["config"]
    if "async eval" in case:  # the child evaluator rebuilds the run from config.json
        cfg = merge(cfg, nested(by_path(s["kwargs"], s["tokens"], s["rows"],
                                        "model state" in case)))
        s = {**s, "kwargs": {}}
        here = str(Path(__file__).resolve().parent)  # where it imports them from
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
            p for p in (here, os.environ.get("PYTHONPATH")) if p))
        # and sees the fake CPU devices this process has (tests/conftest.py sets them
        # in-process, which a child process does not inherit)
        monkeypatch.setenv("JAX_NUM_CPU_DEVICES", str(jax.device_count()))
    if "init_from" in case:
        source = {**cfg, "total_steps": 2, "checkpoint": {
            **cfg["checkpoint"], "local_dir": "", "local_every_steps": 0}}
        source["checkpoint"].pop("keep_top_k", None)
        source["eval"] = {**source["eval"], "mode": "sync"}  # a source run, no evaluator
        jtrain.train(source, os.path.join(root, "source"), **s["kwargs"])
        cfg = merge(cfg, {"init": {"path": os.path.join(root, "source")}})

    def run(name):
        c = cfg
        if c["checkpoint"].get("local_dir"):
            c = merge(c, {"checkpoint": {"local_dir": f"{c['checkpoint']['local_dir']}_{name}"}})
        return jtrain.train(c, f"{base}/{name}", **s["kwargs"])

    ref = run("ref")
    monkeypatch.setenv(faults.FAULT_ENV, f"step:{STOP}:TERM")
    stopped = run("cut")
    monkeypatch.delenv(faults.FAULT_ENV)
    assert (stopped.stopped_by, stopped.summary["step"]) == ("SIGTERM", STOP), case
    if "elastic resume" in case:  # stopped on a 4 x 2 mesh, resumed on 8 x 1
        cfg = merge(cfg, {"mesh": {"data": -1, "fsdp": 1}})
    resumed = run("cut")
    return ref, resumed, s


def check_case(case, ref, resumed, s):
    assert resumed.summary["resumed_from"] == STOP, case
    last = {k: v for k, v in ref.history[-1].items() if k.startswith("eval/")}
    again = {k: v for k, v in resumed.history[-1].items() if k.startswith("eval/")}
    if "elastic resume" in case and "topology invariant" not in case:
        # sums over other device groupings round differently: close, not bitwise
        assert last.keys() == again.keys(), case
        np.testing.assert_allclose([again[k] for k in last], list(last.values()),
                                   rtol=1e-3, err_msg=str(case))
    else:
        assert resumed.summary["state_sha256"] == ref.summary["state_sha256"], case
        assert last and again == last, case
    assert all(np.isfinite(v) for v in last.values()), (case, last)
    ev = s["eval_data"]
    if ev is not None and not s["tokens"] and "population" not in case:
        low = {"bf16", "fp16", "int8"} & set(case)
        np.testing.assert_allclose(last["eval/loss"], hand_eval(ref, ev, case),
                                   rtol=3e-2 if low else 1e-5, err_msg=str(case))


CASES = table.cases(PENDING_FIXES)
ONE_DEVICE = [c for c in CASES if "one device" in c]


def test_the_cases_cover_every_working_pair_and_no_refused_one():
    full = table.cases()
    covered = {table._key(a, b) for c in full for a, b in combinations(c, 2)}
    assert set(table.works_pairs()) <= covered
    assert not covered & set(table.REFUSED)
    for case in full:  # one feature per factor, every required factor present
        factors = [table.feature(n).factor for n in case]
        assert len(set(factors)) == len(factors) and set(table.REQUIRED) <= set(factors)
    pending = {table._key(a, b) for a, b in PENDING_FIXES}
    assert pending <= set(table.works_pairs())  # a pending fix is declared working
    now = {table._key(a, b) for c in CASES for a, b in combinations(c, 2)}
    assert not now & pending and not now & set(table.REFUSED)
    assert set(table.works_pairs()) - pending <= now  # every other working pair runs


def test_the_generator_is_deterministic_and_a_new_feature_is_one_row(monkeypatch):
    assert table.cases() == table.cases()
    extra = table.Feature("new", "new", ("new.key",), {}, "", "concepts.md")
    monkeypatch.setattr(table, "FEATURES", (*table.FEATURES, extra))
    covered = {table._key(a, b) for c in table.cases() for a, b in combinations(c, 2)}
    assert {p for p in table.works_pairs() if "new" in p} <= covered


def test_the_page_is_what_the_table_generates():
    page = REPO / "docs" / "guide" / "feature-interactions.md"
    assert page.read_text() == table.markdown(), (
        "stale: python -m jtrain.config.interactions > docs/guide/feature-interactions.md")


@pytest.mark.slow  # three to four trainings of many features each (~10 CPU s a case)
@pytest.mark.parametrize("case", ONE_DEVICE, ids=[f"case{i}" for i in range(len(ONE_DEVICE))])
def test_a_generated_case_resumes_bitwise_and_evaluates_its_state(case, tmp_path,
                                                                  monkeypatch):
    run_and_check(case, tmp_path, monkeypatch)


def run_and_check(case, tmp_path, monkeypatch):
    with contextlib.ExitStack() as stack:
        root = None
        if "s3:// workdir" in case:
            from journey import s3_server

            bucket = f"matrix-{CASES.index(case)}"  # moto's buckets outlive a server
            stack.enter_context(s3_server(bucket))
            root = f"s3://{bucket}/run"
        ref, resumed, s = train_case(case, tmp_path, monkeypatch, root)
    check_case(case, ref, resumed, s)


@pytest.mark.parametrize("pair", sorted(table.REFUSED), ids=lambda p: "-".join(p))
def test_a_refused_pair_is_one_line_before_step_1(pair, tmp_path):
    s = setup((*pair, "resume"), str(tmp_path), str(tmp_path))
    cfg = s["config"]
    if "init_from" in pair:  # refused before the source is read: it need not exist
        cfg = merge(cfg, {"init": {"path": str(tmp_path / "source")}})
    with contextlib.ExitStack() as stack:
        workdir = str(tmp_path / "run")
        if "s3:// workdir" in pair:
            from journey import s3_server

            stack.enter_context(s3_server("refused"))
            workdir = "s3://refused/run"
        with pytest.raises(errors.ConfigError) as e:
            jtrain.train(cfg, workdir, **s["kwargs"])
    line = errors.render(e.value)
    assert line.startswith("jtrain: config error: ") and "\n" not in line, line
    for name in pair:
        assert any(k in line for k in table.feature(name).keys), (name, line)
    assert not os.path.exists(os.path.join(workdir, "checkpoints"))


def test_invariant_chunks_smaller_than_the_microbatches_are_one_line(tmp_path):
    # A chunk of 2 rows cut into 4 microbatches crashed inside the first step.
    s = setup(("built-in update", "topology invariant"), str(tmp_path), str(tmp_path))
    cfg = merge(s["config"], {"optim": {"grad_accum_steps": 4}})
    with pytest.raises(errors.ConfigError) as e:
        jtrain.train(cfg, str(tmp_path / "run"), **s["kwargs"])
    assert errors.render(e.value) == (
        "jtrain: config error: determinism.chunks: a chunk of 2 rows (data.batch_size=16 / "
        "8) is not divisible by optim.grad_accum_steps=4")
