"""Example weights (0 / 0.5 / 1 / 3) in every metric, against scikit-learn's sample_weight
and, where scikit-learn has no weights, against the data with each example repeated as
often as it weighs. The eval pass itself is driven: padded batches, merged on the host."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from scipy import special, stats
from sklearn import metrics as skm

from jtrain import config as config_lib
from jtrain import data as data_lib
from jtrain import evaluate, losses
from jtrain import mesh as mesh_lib
from jtrain import metrics as M
from jtrain import step as step_lib

N, C, BATCH = 203, 4, 16          # 203 = 12 batches of 16 and a padded one of 11
TOP_K = 2
WEIGHTS = np.float32([0.0, 0.5, 1.0, 3.0])


def assert_close(got, want):
    assert np.isclose(got, want, rtol=1e-6, atol=1e-9), (got, want)


def repeated(w, *arrays):
    """Each row repeated 2·w times (w in {0, 0.5, 1, 3}: whole numbers of copies)."""
    times = np.rint(2 * w).astype(int)
    return [np.repeat(a, times, axis=0) for a in arrays]


@functools.lru_cache(maxsize=None)
def data():
    rng = np.random.default_rng(7)
    labels = rng.integers(0, C, N).astype(np.int32)
    logits = (rng.normal(size=(N, C)) + 0.9 * np.eye(C)[labels]).astype(np.float32)
    w = rng.choice(WEIGHTS, N)
    x = rng.normal(size=(N, 1)).astype(np.float32)
    y = np.round(3.0 + x + rng.normal(size=(N, 1)), 1).astype(np.float32)  # ties for ranks
    return labels, logits, w, x, y


def eval_pass(inputs, targets, w, names):
    """The engine's eval pass over (inputs, targets, weights): identity model, outputs =
    inputs; padded batches through the jitted eval step, AUROC / Spearman on the host."""
    cfg = config_lib.resolve({"eval": {"metrics": names, "top_k": TOP_K}})
    eye = np.eye(inputs.shape[-1], dtype=np.float32)

    def apply(p, x, rng=None, train=False):
        return x @ p
    spec = evaluate.make_spec(cfg.eval, apply, eye,
                              jax.ShapeDtypeStruct((BATCH,) + inputs.shape[1:], jnp.float32),
                              {"targets": targets[0]})
    mesh = mesh_lib.make_mesh(cfg.mesh)
    eval_step = jax.jit(step_lib.make_eval_step(apply, losses.default_loss, user_loss=False,
                                                metrics=spec))
    source = data_lib.as_data((inputs, targets, w), "eval")
    with jax.set_mesh(mesh):
        return evaluate.run_eval(eval_step, eye, source, mesh=mesh, local_batch=BATCH,
                                 spec=spec)


@functools.lru_cache(maxsize=None)
def classification_eval():
    labels, logits, w, _, _ = data()
    return eval_pass(logits, labels, w, ["loss", "accuracy", "top_k_accuracy",
                                         "precision_recall_f1", "confusion_matrix", "auroc"])


def test_classification_eval_weighs_like_sklearn():
    labels, logits, w, _, _ = data()
    result = classification_eval()
    got, classes = result.scalars, list(range(C))
    preds = logits.argmax(-1)
    assert_close(got["eval/accuracy"], skm.accuracy_score(labels, preds, sample_weight=w))
    assert_close(got[f"eval/top_{TOP_K}_accuracy"], skm.top_k_accuracy_score(
        labels, logits, k=TOP_K, labels=classes, sample_weight=w))
    for avg in ("macro", "micro"):
        p, r, f, _ = skm.precision_recall_fscore_support(
            labels, preds, labels=classes, average=avg, sample_weight=w, zero_division=0)
        assert_close(got[f"eval/precision_{avg}"], p)
        assert_close(got[f"eval/recall_{avg}"], r)
        assert_close(got[f"eval/f1_{avg}"], f)
    p, r, f, _ = skm.precision_recall_fscore_support(labels, preds, labels=classes,
                                                     sample_weight=w, zero_division=0)
    for i in classes:
        assert_close(got[f"eval/precision/{i}"], p[i])
        assert_close(got[f"eval/f1/{i}"], f[i])
    np.testing.assert_allclose(
        result.arrays["confusion_matrix"],
        skm.confusion_matrix(labels, preds, labels=classes, sample_weight=w), rtol=1e-12)
    probs = special.softmax(logits.astype(np.float64), axis=-1)
    assert_close(got["eval/auroc"], skm.roc_auc_score(labels, probs, multi_class="ovr",
                                                      average="macro", sample_weight=w))
    assert result.num_examples == N


def test_regression_eval_weighs_like_sklearn():
    _, _, w, x, y = data()
    got = eval_pass(x, y, w, ["loss", "mse", "mae", "r2", "pearson", "spearman"]).scalars
    x64, y64 = x[:, 0].astype(np.float64), y[:, 0].astype(np.float64)
    assert_close(got["eval/mse"], skm.mean_squared_error(y64, x64, sample_weight=w))
    assert_close(got["eval/mae"], skm.mean_absolute_error(y64, x64, sample_weight=w))
    assert_close(got["eval/r2"], skm.r2_score(y64, x64, sample_weight=w))
    rx, ry = repeated(w, x64, y64)
    assert_close(got["eval/pearson"], stats.pearsonr(rx, ry).statistic)
    assert_close(got["eval/spearman"], stats.spearmanr(rx, ry).statistic)


def batches(n, size, seed):
    """Index slices of a padded pass: (rows, pad) per batch."""
    for start in range(0, n, size):
        rows = np.arange(start, min(start + size, n))
        yield rows, size - len(rows)


def test_binary_auroc_with_ties_weighs_like_sklearn():
    rng = np.random.default_rng(3)
    n = 301
    labels = rng.integers(0, 2, n)
    scores = np.round(rng.normal(size=n) + labels, 1)   # ties across the classes
    w = rng.choice(WEIGHTS, n)
    m = M.AUROC.empty()
    for rows, pad in batches(n, 40, 0):
        m = m.update(scores=np.concatenate([scores[rows], np.full(pad, 9.0)]),
                     labels=np.concatenate([labels[rows], np.zeros(pad, int)]),
                     mask=np.concatenate([w[rows], np.zeros(pad)]))
    assert_close(m.compute(), skm.roc_auc_score(labels, scores, sample_weight=w))


def test_token_accuracy_weighs_each_token():
    """[B, T] labels with a per-token mask: each token weighs its mask, merged over batches."""
    rng = np.random.default_rng(5)
    labels = rng.integers(0, C, (40, 6))
    logits = rng.normal(size=(40, 6, C)).astype(np.float32)
    w = rng.choice(WEIGHTS, (40, 6))
    update = jax.jit(lambda m, b: m.update(**b))
    acc = M.Accuracy.empty()
    for rows, _ in batches(40, 16, 0):
        acc = acc.merge(update(M.Accuracy.empty(), dict(
            logits=logits[rows], labels=labels[rows], mask=w[rows])))
    assert_close(acc.compute(), skm.accuracy_score(labels.ravel(), logits.argmax(-1).ravel(),
                                                   sample_weight=w.ravel()))
