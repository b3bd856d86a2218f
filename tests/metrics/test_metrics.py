"""jtrain.metrics against scikit-learn / scipy on whole datasets, fed in padded batches."""

import functools
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax

import numpy as np
import pytest
from scipy import special, stats
from sklearn import metrics as skm

from jtrain import metrics as M

NUM_CLASSES = 5
TOP_K = 2
# (dataset size, batch size, seed): batch sizes that divide nothing, one larger than the data.
CASES = [(1, 4, 0), (7, 3, 1), (333, 50, 2), (1000, 96, 3), (2049, 256, 4), (10_000, 1024, 5)]
CASE_IDS = [f"n{n}-b{b}" for n, b, _ in CASES]


def assert_close(got, want, rel=1e-6):
    if isinstance(want, float) and math.isnan(want):
        assert math.isnan(got), got
    else:
        assert math.isclose(got, want, rel_tol=rel, abs_tol=1e-12), (got, want)


# ----------------------------------------------------------------------------------------
# Data and batching


def make_data(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    c, t = NUM_CLASSES, 6
    labels = rng.integers(0, c, n)
    logits = (rng.normal(size=(n, c)) + 1.2 * np.eye(c)[labels]).astype(np.float32)
    blabels = rng.integers(0, 2, n)
    if n >= 2:
        blabels[:2] = [0, 1]
    # Rounded scores: ties between positives and negatives, as sklearn handles them.
    bscores = np.round(rng.normal(size=n) + blabels, 1).astype(np.float32)
    x = rng.normal(size=n).astype(np.float32)
    # A large offset exercises the centred moments; rounding makes ties for Spearman.
    y = np.round(100.0 + 2.0 * x + rng.normal(size=n), 1).astype(np.float32)
    tok_labels = rng.integers(0, c, (n, t))
    tok_logits = (rng.normal(size=(n, t, c)) + np.eye(c)[tok_labels]).astype(np.float32)
    tok_loss = rng.exponential(2.0, size=(n, t)).astype(np.float32)
    tok_mask = rng.choice(np.float32([0, 1, 1, 1, 0.5, 2]), size=(n, t))
    return dict(labels=labels, logits=logits, blabels=blabels, bscores=bscores, x=x, y=y,
                tok_labels=tok_labels, tok_logits=tok_logits, tok_loss=tok_loss,
                tok_mask=tok_mask)


def padded_batches(arrays: dict, batch_size: int, seed: int = 0, bool_mask: bool = False,
                   mask: np.ndarray | None = None):
    """Yields fixed-size batches; the last is padded with garbage rows and mask 0."""
    rng = np.random.default_rng(seed)
    n = len(next(iter(arrays.values())))
    if mask is None:
        mask = np.ones(n, np.float32)
    for start in range(0, n, batch_size):
        pad = max(start + batch_size - n, 0)
        batch = {}
        for key, value in list(arrays.items()) + [("mask", mask)]:
            chunk = value[start:start + batch_size]
            if key == "mask":
                garbage = np.zeros((pad,) + chunk.shape[1:], chunk.dtype)
            elif np.issubdtype(chunk.dtype, np.floating) and seed % 2 == 0:
                # Even seeds: NaN/inf rows (masking must not multiply them in).
                garbage = np.full((pad,) + chunk.shape[1:], np.nan, chunk.dtype)
                garbage.reshape(-1)[::2] = np.inf
            elif np.issubdtype(chunk.dtype, np.floating):
                # Odd seeds: plausible finite rows, which a metric that ignores the mask
                # would count without turning its result into NaN.
                garbage = (rng.normal(size=(pad,) + chunk.shape[1:]) * 3 + 1).astype(chunk.dtype)
            else:
                # Labels of a real class (1 is one in every view here): a metric that
                # ignores the mask counts these rows.
                garbage = np.ones((pad,) + chunk.shape[1:], chunk.dtype)
            batch[key] = np.concatenate([chunk, garbage])
        if bool_mask:
            batch["mask"] = batch["mask"] > 0
        yield batch


def batch_states(template, batches, jit=True):
    step = jax.jit(lambda b: template.update(**b)) if jit else (lambda b: template.update(**b))
    return [jax.device_get(step(b)) for b in batches]


def merge_all(template, parts):
    return functools.reduce(lambda a, b: a.merge(b), parts, template)


CLASSIFICATION = M.MetricCollection.empty({
    "accuracy": M.Accuracy.empty(),
    "top_k": M.TopKAccuracy.empty(k=TOP_K),
    "prf": M.PrecisionRecallF1.empty(NUM_CLASSES),
})
TOKENS = M.MetricCollection.empty({
    "token_accuracy": M.Accuracy.empty(),
    "loss": M.Loss.empty(),
    "perplexity": M.Perplexity.empty(),
    "bits_per_byte": M.BitsPerByte.empty(),
})
REGRESSION = M.MetricCollection.empty({
    "mse": M.MSE.empty(), "mae": M.MAE.empty(), "r2": M.R2.empty(), "pearson": M.Pearson.empty(),
})


def class_view(d):
    return dict(logits=d["logits"], labels=d["labels"])


def token_view(d):
    return dict(logits=d["tok_logits"], labels=d["tok_labels"], loss=d["tok_loss"])


def regression_view(d):
    return dict(preds=d["x"], labels=d["y"])


def accumulate(d: dict, batch_size: int, seed: int, merge_template=None) -> dict[str, float]:
    """Every metric of this module over dataset d, fed in padded batches."""
    out = {}
    cls = merge_all(CLASSIFICATION, batch_states(
        CLASSIFICATION, padded_batches(class_view(d), batch_size, seed, bool_mask=seed % 2 == 1)))
    out.update(cls.compute())
    out["confusion"] = cls.metrics["prf"].confusion.compute()
    tok = merge_all(TOKENS, batch_states(
        TOKENS, padded_batches(token_view(d), batch_size, seed, mask=d["tok_mask"])))
    out.update(tok.compute())
    reg = merge_all(REGRESSION, batch_states(
        REGRESSION, padded_batches(regression_view(d), batch_size, seed)))
    out.update(reg.compute())
    # Host-side metrics: plain numpy batches, no jit.
    ovr, ovr_logits = M.AUROC.empty(NUM_CLASSES), M.AUROC.empty(NUM_CLASSES)
    probs = special.softmax(d["logits"].astype(np.float64), axis=-1)
    for b in padded_batches(dict(scores=probs, labels=d["labels"]), batch_size, seed):
        ovr = ovr.update(**b)
    for b in padded_batches(class_view(d), batch_size, seed):
        ovr_logits = ovr_logits.update(**b)
    binary = M.AUROC.empty()
    for b in padded_batches(dict(scores=d["bscores"], labels=d["blabels"]), batch_size, seed):
        binary = binary.update(**b)
    spearman = M.Spearman.empty()
    for b in padded_batches(regression_view(d), batch_size, seed):
        spearman = spearman.update(**b)
    out.update(auroc_ovr=ovr.compute(), auroc_ovr_logits=ovr_logits.compute(),
               auroc_binary=binary.compute(), spearman=spearman.compute())
    return out


def reference(d: dict) -> dict[str, float]:
    """The same quantities from scikit-learn / scipy on the whole dataset."""
    labels, logits, n = d["labels"], d["logits"], len(d["labels"])
    preds = logits.argmax(-1)
    classes = list(range(NUM_CLASSES))
    ref = {
        "accuracy": skm.accuracy_score(labels, preds),
        "top_k": skm.top_k_accuracy_score(labels, logits, k=TOP_K, labels=classes),
        "confusion": skm.confusion_matrix(labels, preds, labels=classes),
    }
    for avg in ("macro", "micro"):
        p, r, f, _ = skm.precision_recall_fscore_support(
            labels, preds, labels=classes, average=avg, zero_division=0)
        ref.update({f"precision_{avg}": p, f"recall_{avg}": r, f"f1_{avg}": f})
        assert math.isclose(f, skm.f1_score(labels, preds, labels=classes, average=avg,
                                            zero_division=0))
    p, r, f, _ = skm.precision_recall_fscore_support(labels, preds, labels=classes,
                                                     zero_division=0)
    for i in classes:
        ref.update({f"precision/{i}": p[i], f"recall/{i}": r[i], f"f1/{i}": f[i]})
    # Tokens: a float mask weights the averages and the accuracy alike.
    w = d["tok_mask"].astype(np.float64)
    ref["token_accuracy"] = (skm.accuracy_score(d["tok_labels"].ravel(),
                                                d["tok_logits"].argmax(-1).ravel(),
                                                sample_weight=w.ravel())
                             if w.sum() else math.nan)
    mean_loss = np.average(d["tok_loss"].astype(np.float64), weights=w) if w.sum() else math.nan
    ref.update(loss=mean_loss, perplexity=math.exp(mean_loss),
               bits_per_byte=mean_loss / math.log(2))
    x, y = d["x"].astype(np.float64), d["y"].astype(np.float64)
    ref["mse"] = skm.mean_squared_error(y, x)
    ref["mae"] = skm.mean_absolute_error(y, x)
    ref["r2"] = skm.r2_score(y, x) if n >= 2 else math.nan
    ref["pearson"] = stats.pearsonr(x, y).statistic if n >= 2 else math.nan
    ref["spearman"] = stats.spearmanr(x, y).statistic if n >= 2 else math.nan
    probs = special.softmax(logits.astype(np.float64), axis=-1)
    all_present = len(np.unique(labels)) == NUM_CLASSES
    ref["auroc_ovr"] = (skm.roc_auc_score(labels, probs, multi_class="ovr", average="macro")
                        if all_present else math.nan)
    ref["auroc_ovr_logits"] = ref["auroc_ovr"]
    ref["auroc_binary"] = (skm.roc_auc_score(d["blabels"], d["bscores"])
                           if len(np.unique(d["blabels"])) == 2 else math.nan)
    return {k: (float(v) if np.ndim(v) == 0 else v) for k, v in ref.items()}


@functools.lru_cache(maxsize=None)
def case_results(case_index: int):
    n, batch_size, seed = CASES[case_index]
    d = make_data(n, seed)
    return accumulate(d, batch_size, seed), reference(d)


SCALAR_KEYS = ["accuracy", "top_k", "precision_macro", "recall_macro", "f1_macro",
               "precision_micro", "recall_micro", "f1_micro", "token_accuracy", "loss",
               "perplexity", "bits_per_byte", "mse", "mae", "r2", "pearson", "spearman",
               "auroc_binary", "auroc_ovr", "auroc_ovr_logits"]


# ----------------------------------------------------------------------------------------
# Equality with sklearn / scipy


@pytest.mark.parametrize("case", range(len(CASES)), ids=CASE_IDS)
@pytest.mark.parametrize("key", SCALAR_KEYS)
def test_matches_reference(case, key):
    got, want = case_results(case)
    assert_close(got[key], want[key])


@pytest.mark.parametrize("case", range(len(CASES)), ids=CASE_IDS)
def test_confusion_and_per_class(case):
    got, want = case_results(case)
    np.testing.assert_array_equal(got["confusion"], want["confusion"])
    assert got["confusion"].dtype == np.float64   # summed weights, 1 per example here
    for key in want:
        if "/" in key:
            assert_close(got[key], want[key])


# Where a reference value is NaN the comparison proves little (NaN == NaN): these are
# the only NaNs allowed, each undefined for a reason (no variance, a class never seen).
EXPECTED_NAN = {0: {"r2", "pearson", "spearman", "auroc_binary", "auroc_ovr",
                    "auroc_ovr_logits"},
                1: {"auroc_ovr", "auroc_ovr_logits"}}  # 7 examples miss a class


@pytest.mark.parametrize("case", sorted(EXPECTED_NAN), ids=[CASE_IDS[c] for c in EXPECTED_NAN])
def test_small_cases_are_nan_only_where_undefined(case):
    got, want = case_results(case)
    assert {k for k in SCALAR_KEYS if math.isnan(want[k])} == EXPECTED_NAN[case]
    assert {k for k in SCALAR_KEYS if math.isnan(got[k])} == EXPECTED_NAN[case]


def test_large_cases_are_not_degenerate():
    """The big cases must test real values, not nan == nan."""
    got, _ = case_results(len(CASES) - 1)
    for key in SCALAR_KEYS:
        assert math.isfinite(got[key]), key
    assert 0.5 < got["pearson"] < 1 and 0.5 < got["auroc_ovr"] < 1


def test_compute_returns_python_floats():
    got, _ = case_results(2)
    assert all(type(got[k]) is float for k in SCALAR_KEYS)


# ----------------------------------------------------------------------------------------
# Merging


def random_tree_merge(parts, rng):
    parts = list(parts)
    while len(parts) > 1:
        i = int(rng.integers(len(parts) - 1))
        parts[i:i + 2] = [parts[i].merge(parts[i + 1])]
    return parts[0]


def test_merge_order_independent():
    d = make_data(1000, 11)
    rng = np.random.default_rng(0)
    for template, view in [(CLASSIFICATION, class_view), (REGRESSION, regression_view)]:
        parts = batch_states(template, padded_batches(view(d), 77))
        base = merge_all(template, parts).compute()
        for _ in range(3):
            shuffled = [parts[i] for i in rng.permutation(len(parts))]
            other = random_tree_merge([template] + shuffled, rng).compute()
            assert base.keys() == other.keys()
            for key in base:
                assert_close(other[key], base[key], rel=1e-12)
    spearman_parts = [M.Spearman.empty().update(**b)
                      for b in padded_batches(regression_view(d), 77)]
    a = merge_all(M.Spearman.empty(), spearman_parts).compute()
    b = random_tree_merge(spearman_parts[::-1], rng).compute()
    assert_close(a, b, rel=1e-12)


def test_update_outside_jit_equals_jitted():
    d = make_data(300, 12)
    eager = merge_all(REGRESSION, batch_states(REGRESSION, padded_batches(regression_view(d), 64),
                                               jit=False)).compute()
    jitted = merge_all(REGRESSION, batch_states(REGRESSION,
                                                padded_batches(regression_view(d), 64))).compute()
    for key in eager:
        assert_close(eager[key], jitted[key])


def test_host_merge_is_float64_and_carry_under_jit_is_float32():
    state = M.Average.empty().update(values=np.ones(3, np.float32))
    assert state.total.dtype == np.float64
    carried = jax.jit(lambda m, b: m.update(**b))(M.Average.empty(), {"values": np.ones(3)})
    assert carried.total.dtype == np.float32 and carried.compute() == 1.0


def test_empty_metrics():
    assert math.isnan(M.Accuracy.empty().compute())
    assert math.isnan(M.Loss.empty().compute())
    assert math.isnan(M.AUROC.empty().compute())
    assert math.isnan(M.Pearson.empty().compute())
    assert M.PrecisionRecallF1.empty(3).compute()["f1_macro"] == 0.0
    all_padding = M.Accuracy.empty().update(logits=np.zeros((2, 3)), labels=np.zeros(2, int),
                                            mask=np.zeros(2))
    assert math.isnan(all_padding.compute())


def test_example_mask_broadcasts_over_tokens():
    labels = np.array([[0, 1, 2], [2, 2, 2]])
    preds = np.array([[0, 1, 0], [0, 0, 0]])
    acc = M.Accuracy.empty().update(preds=preds, labels=labels, mask=np.array([1.0, 0.0]))
    assert acc.compute() == 2 / 3
    with pytest.raises(ValueError, match="prefix"):
        M.Accuracy.empty().update(preds=preds, labels=labels, mask=np.ones(3))


def test_errors_are_clear():
    with pytest.raises(ValueError, match="max_examples"):
        M.AUROC.empty(max_examples=5).update(scores=np.arange(6.0), labels=np.arange(6) % 2)
    # Padded entries do not count against the buffer.
    M.AUROC.empty(max_examples=5).update(scores=np.arange(6.0), labels=np.arange(6) % 2,
                                         mask=np.arange(6) < 5)
    with pytest.raises(TypeError, match="outside jax.jit"):
        jax.jit(lambda s: M.AUROC.empty().update(scores=s, labels=s))(np.ones(3))
    with pytest.raises(ValueError, match="different options"):
        M.TopKAccuracy.empty(k=1).merge(M.TopKAccuracy.empty(k=2))
    with pytest.raises(TypeError):
        M.Accuracy.empty().merge(M.Loss.empty())
    with pytest.raises(KeyError, match="labels"):
        M.Accuracy.empty().update(logits=np.zeros((2, 3)))
    with pytest.raises(TypeError, match="not a metric"):
        M.MetricCollection.empty({"x": 3})
    twice = M.MetricCollection.empty({"a": M.PrecisionRecallF1.empty(2),
                                      "b": M.PrecisionRecallF1.empty(2)})
    with pytest.raises(ValueError, match="key 'precision_macro'"):
        twice.compute()
    with pytest.raises(ValueError, match="different metric names"):
        twice.merge(M.MetricCollection.empty({"a": M.PrecisionRecallF1.empty(2)}))


def test_collection_partition_and_single_process_reduce():
    both = M.MetricCollection.empty({"accuracy": M.Accuracy.empty(),
                                     "auroc": M.AUROC.empty(NUM_CLASSES)})
    device, host = both.partition()
    assert device.JITTABLE and not host.JITTABLE and not both.JITTABLE
    assert list(device.metrics) == ["accuracy"] and list(host.metrics) == ["auroc"]
    assert M.reduce_across_processes(both) is both


# ----------------------------------------------------------------------------------------
# Eight devices


@pytest.mark.multidevice
def test_sharded_update_equals_single_device():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    sharded = NamedSharding(mesh, P("data"))
    d = make_data(500, 21)
    for template, view, mask in [(CLASSIFICATION, class_view, None),
                                 (TOKENS, token_view, d["tok_mask"]),
                                 (REGRESSION, regression_view, None)]:
        batches = list(padded_batches(view(d), 64, mask=mask))
        single = merge_all(template, batch_states(template, batches)).compute()
        on_mesh = merge_all(template, batch_states(
            template, [jax.device_put(b, sharded) for b in batches])).compute()
        assert single.keys() == on_mesh.keys()
        for key in single:
            assert_close(on_mesh[key], single[key])


# ----------------------------------------------------------------------------------------
# Two processes

CHILD = r'''
import json, sys
import jax
import numpy as np

process_id, port, data_path, out_path = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=process_id, initialization_timeout=60)
from jtrain import metrics as M

d = dict(np.load(data_path))
split = int(d["split"])
part = slice(0, split) if process_id == 0 else slice(split, None)
NUM_CLASSES = int(d["num_classes"])

def batches(arrays, batch_size):
    n = len(next(iter(arrays.values())))
    for start in range(0, n, batch_size):
        pad = max(start + batch_size - n, 0)
        b = {k: np.concatenate([v[start:start + batch_size],
                                np.full((pad,) + v.shape[1:], -7, v.dtype)])
             for k, v in arrays.items()}
        b["mask"] = np.arange(batch_size) < batch_size - pad
        yield b

cls_t = M.MetricCollection.empty({
    "accuracy": M.Accuracy.empty(), "top_k": M.TopKAccuracy.empty(k=2),
    "prf": M.PrecisionRecallF1.empty(NUM_CLASSES, per_class=False)})
reg_t = M.MetricCollection.empty({"mse": M.MSE.empty(), "r2": M.R2.empty(),
                                  "pearson": M.Pearson.empty()})
cls_step = jax.jit(lambda b: cls_t.update(**b))
reg_step = jax.jit(lambda b: reg_t.update(**b))
cls, reg = cls_t, reg_t
auroc, spearman = M.AUROC.empty(NUM_CLASSES), M.Spearman.empty()
local = {k: d[k][part] for k in ("logits", "labels", "x", "y")}
for b in batches(local, 40):
    cls = cls.merge(cls_step(dict(logits=b["logits"], labels=b["labels"], mask=b["mask"])))
    reg = reg.merge(reg_step(dict(preds=b["x"], labels=b["y"], mask=b["mask"])))
    auroc = auroc.update(logits=b["logits"], labels=b["labels"], mask=b["mask"])
    spearman = spearman.update(preds=b["x"], labels=b["y"], mask=b["mask"])
host = M.MetricCollection.empty({"auroc_ovr": auroc, "spearman": spearman})
out = {}
for collection in (cls, reg, host):
    out.update(M.reduce_across_processes(collection).compute())
out["confusion"] = M.reduce_across_processes(
    cls.metrics["prf"].confusion).compute().tolist()

# A jitted step over a global batch already covers both processes: reduce must not re-sum it.
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()), ("data",))
rows = 30
local_batch = {k: d[k][process_id * rows:(process_id + 1) * rows] for k in ("logits", "labels")}
global_batch = {k: jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), v)
                for k, v in local_batch.items()}
acc = jax.jit(lambda b: M.Accuracy.empty().update(**b),
              out_shardings=NamedSharding(mesh, P()))(global_batch)
reduced = M.reduce_across_processes(acc)
out["global_accuracy"], out["global_count"] = reduced.compute(), int(reduced.count)
# One process holding nothing: its empty buffer still takes part in the gather.
only_first = spearman if process_id == 0 else M.Spearman.empty()
out["spearman_first_only"] = M.reduce_across_processes(only_first).compute()

# The eval loop itself: a jitted eval step over global batches (1 device per process), the
# host-side AUROC fed each process's rows of them and gathered at the end.
import jax.numpy as jnp
from jtrain import config as config_lib, data as data_lib, losses
from jtrain import evaluate
from jtrain import mesh as mesh_lib, step as step_lib
cfg = config_lib.resolve({"eval": {"metrics": ["loss", "accuracy", "auroc"]}})
apply = lambda p, x, rng=None, train=False: x @ p  # identity weights: outputs = logits
eye = np.eye(NUM_CLASSES, dtype=np.float32)
spec = evaluate.make_spec(cfg.eval, apply, eye,
                          jax.ShapeDtypeStruct((16, NUM_CLASSES), jnp.float32),
                          {"targets": d["labels"][0]})
mesh = mesh_lib.make_mesh(cfg.mesh)
eval_step = jax.jit(step_lib.make_eval_step(apply, losses.default_loss, user_loss=False,
                                            metrics=spec),
                    out_shardings=(mesh_lib.replicated(mesh), mesh_lib.batch_sharding(mesh),
                                   mesh_lib.replicated(mesh)))
source = data_lib.as_data((d["logits"], d["labels"].astype(np.int32)), "eval")
result = evaluate.run_eval(eval_step, eye, source, mesh=mesh, local_batch=8, spec=spec)
out["run_eval"] = dict(result.scalars, num_examples=result.num_examples)
with open(out_path, "w") as f:
    json.dump(out, f)
jax.distributed.shutdown()
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_reduce(tmp_path):
    n, split = 1234, 517   # unequal halves; 517 and 717 are no multiples of the batch size 40
    d = make_data(n, 31)
    np.savez(tmp_path / "data.npz", split=split, num_classes=NUM_CLASSES,
             **{k: d[k] for k in ("logits", "labels", "x", "y")})
    (tmp_path / "child.py").write_text(CHILD)
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    env.pop("XLA_FLAGS", None)
    port = free_port()
    prefix = ["timeout", "-s", "KILL", "150"] if shutil.which("timeout") else []
    procs, logs = [], []
    try:
        for i in range(2):
            procs.append(subprocess.Popen(
                prefix + [sys.executable, str(tmp_path / "child.py"), str(i), str(port),
                          str(tmp_path / "data.npz"), str(tmp_path / f"out{i}.json")],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True))
        deadline = time.monotonic() + 120
        for p in procs:
            logs.append(p.communicate(timeout=max(deadline - time.monotonic(), 1))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                # Its own process group: the worker too when `timeout` wraps it. SIGKILL, because
                # processes in jax.distributed catch SIGTERM (preemption notifier).
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]

    ref = reference(d)
    rows = 30
    want_global = skm.accuracy_score(d["labels"][:2 * rows], d["logits"][:2 * rows].argmax(-1))
    for i in range(2):
        got = json.loads((tmp_path / f"out{i}.json").read_text())
        for key in ["accuracy", "top_k", "precision_macro", "recall_macro", "f1_macro",
                    "f1_micro", "mse", "r2", "pearson", "auroc_ovr", "spearman"]:
            assert_close(got[key], ref[key])
        np.testing.assert_array_equal(got["confusion"], ref["confusion"])
        assert_close(got["global_accuracy"], want_global)
        assert got["global_count"] == 2 * rows   # not summed a second time
        assert_close(got["spearman_first_only"],
                     stats.spearmanr(d["x"][:split], d["y"][:split]).statistic)
        ev = got["run_eval"]
        assert ev["num_examples"] == n
        assert_close(ev["eval/accuracy"], ref["accuracy"])
        assert_close(ev["eval/auroc"], ref["auroc_ovr"])
        probs = special.softmax(d["logits"].astype(np.float64), axis=-1)
        assert_close(ev["eval/loss"], skm.log_loss(d["labels"], probs), rel=1e-5)


def test_classification_report_matches_sklearn():
    from jtrain.metrics.classification import classification_report

    rng = np.random.default_rng(0)
    y, p = rng.integers(0, 4, 200), rng.integers(0, 4, 200)
    p[y == 3] = 0  # class 3 never predicted: zero_division=0
    cm = skm.confusion_matrix(y, p, labels=range(5))  # class 4: no support at all
    got = classification_report(cm)
    want = skm.classification_report(y, p, labels=range(5), output_dict=True,
                                     zero_division=0)
    assert set(got) == {"0", "1", "2", "3", "4", "accuracy", "macro avg", "weighted avg"}
    for key in ("0", "3", "4", "macro avg", "weighted avg"):
        for field in ("precision", "recall", "f1-score", "support"):
            assert got[key][field] == pytest.approx(want[key][field], abs=1e-12), (key, field)
    assert got["accuracy"] == pytest.approx(skm.accuracy_score(y, p))
