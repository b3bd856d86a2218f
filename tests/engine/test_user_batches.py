"""Your batch, your predictions, your loss from config:

* dict items without `inputs`: the model gets the whole batch (or the fields
  `data.model_inputs` names) and `loss_fn(outputs, batch)` sees every field;
* `eval.predict_fn` maps outputs to what the metrics compare, so a model that outputs
  distribution parameters gets R², Pearson, Spearman and MSE (checked against numpy);
* `loss.eval_scope`: a batch-level loss (a correlation) scored over the padded eval batch
  with padding masked, and a per-example mean that ignores the mask scored one example
  at a time; each checked exact against numpy on an eval set whose last batch is padded;
* `loss.terms`: a weighted multi-loss from config, each term logged and exact at eval;
* bad keys are one-line ConfigErrors; and the same from the CLI as a user runs it.
"""

import json
import sys
import textwrap

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

import jtrain
from jtrain import losses
from jtrain.errors import ConfigError, DataError
from journey import run_python

F = 6  # features


def tracks(n=48, seed=0):
    """Genomics-like items: counts per feature, an availability mask, metadata."""
    rng = np.random.default_rng(seed)
    x = rng.poisson(3.0, size=(n, F)).astype(np.float32)
    avail = (rng.random((n, F)) > 0.2).astype(np.float32)
    return {"x_data": x, "x_avail": avail, "y_data": x * 1.5 + 1.0,
            "meta": rng.normal(size=(n, 2)).astype(np.float32)}


class NBNet(nn.Module):
    """Takes the whole batch (a dict); outputs NB mean and dispersion per feature."""

    @nn.compact
    def __call__(self, batch, train=False):
        h = jnp.concatenate([batch["x_data"] * batch["x_avail"], batch["meta"]], -1)
        h = nn.relu(nn.Dense(16)(h))
        return {"mean": nn.softplus(nn.Dense(F)(h)) + 1e-3,
                "dispersion": nn.softplus(nn.Dense(F)(h)) + 1e-3}


def nb_loss(outputs, batch):
    return losses.negative_binomial_nll(batch["y_data"], outputs["mean"],
                                        outputs["dispersion"],
                                        weights=losses.weights_for(batch, batch["y_data"].shape))


def nb_predict(outputs, batch):  # the NB mean vs the counts, on available features
    return outputs["mean"], batch["y_data"], batch["x_avail"]


def _cfg(**over):
    return {"total_steps": 4, "data": {"batch_size": 8, "shuffle": False},
            "eval": {"every_steps": 0, "batch_size": 8},
            "log": {"every_steps": 1, "verbosity": 0, "writers": ("jsonl",)},
            "optim": {"name": "sgd", "lr": 0.01, "schedule": "constant"}, **over}


@pytest.mark.slow  # seconds of CPU: the full suite runs it (tests/README.md)
def test_whole_batch_model_with_predict_fn_metrics(tmp_path, monkeypatch):
    import types

    mod = types.ModuleType("user_preds")
    mod.nb_predict = nb_predict
    monkeypatch.setitem(sys.modules, "user_preds", mod)
    ev = tracks(n=13, seed=1)  # 13 rows, batches of 8: the last one is padded
    res = jtrain.train(_cfg(eval={"every_steps": 0, "batch_size": 8,
                                  "predict_fn": "user_preds:nb_predict"}),
                       str(tmp_path / "r"), model=NBNet(), train_data=tracks(),
                       eval_data=ev, loss_fn=nb_loss)
    m = res.history[-1]
    out = jtrain.to_model_fns(NBNet()).apply(res.state.params, ev, rng=None, train=False)
    keep = ev["x_avail"] > 0
    pred, y = np.asarray(out["mean"], np.float64)[keep], ev["y_data"][keep]
    np.testing.assert_allclose(m["eval/mse"], np.mean((pred - y) ** 2), rtol=1e-5)
    # r2: the F features are F outputs (scikit-learn's default), each over its available
    # entries, averaged.
    mean, ys = np.asarray(out["mean"], np.float64), ev["y_data"]
    per_feature = [1 - np.sum((ys[k, f] - mean[k, f]) ** 2)
                   / np.sum((ys[k, f] - ys[k, f].mean()) ** 2) for f, k in enumerate(keep.T)]
    np.testing.assert_allclose(m["eval/r2"], np.mean(per_feature), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(m["eval/pearson"], scipy.stats.pearsonr(pred, y)[0],
                               rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(m["eval/spearman"], scipy.stats.spearmanr(pred, y)[0],
                               rtol=1e-4, atol=1e-6)
    # The loss_fn came from Python: the evaluate CLI cannot rebuild it and says how.
    from jtrain import evaluate
    from jtrain.errors import EvaluateError

    assert json.load(open(tmp_path / "r" / "run.json"))["loss_source"] == "python: nb_loss"
    with pytest.raises(EvaluateError, match="loss_fn passed from Python"):
        evaluate.evaluate_checkpoint(str(tmp_path / "r"), model=NBNet(), data=ev, plots=False)
    report = evaluate.evaluate_checkpoint(str(tmp_path / "r"), model=NBNet(), data=ev,
                                          loss_fn=nb_loss, plots=False)
    for k in ("eval/loss", "eval/r2", "eval/spearman"):
        np.testing.assert_allclose(report["metrics"][k], m[k], rtol=1e-5, err_msg=k)


def test_model_inputs_picks_fields():
    from jtrain.step import inputs_of

    b = tracks(n=2)
    assert inputs_of(b, ("x_data",)) is b["x_data"]
    assert set(inputs_of(b, ("x_data", "meta"))) == {"x_data", "meta"}
    assert set(inputs_of({**b, losses.ROW_MASK: np.ones(2)})) == set(b)  # the row mask: no input
    assert set(inputs_of({**b, "mask": np.ones(2)})) == {*b, "mask"}  # the user's field is
    with pytest.raises(ConfigError, match="data.model_inputs: no field 'x'"):
        jtrain.train(_cfg(data={"batch_size": 8, "model_inputs": ("x",)}), "/tmp/unused-x",
                     model=nn.Dense(F), train_data=tracks(), loss_fn=nb_loss)


def test_no_targets_with_default_loss_is_one_line(tmp_path):
    with pytest.raises(DataError) as e:
        jtrain.train(_cfg(), str(tmp_path / "r"), model=NBNet(), train_data=tracks())
    assert "no 'targets' field" in str(e.value) and "loss_fn" in str(e.value)
    assert "\n" not in str(e.value)


def pearson_only(outputs, batch):  # batch-level: honours the row mask through weights_for
    return losses.pearson_loss(outputs, batch["y_data"],
                               weights=losses.weights_for(batch, batch["y_data"].shape))


def mean_ignoring_mask(outputs, batch):  # per-example mean, blind to padding
    return jnp.mean((outputs - batch["y_data"]) ** 2)


def _np_pearson_loss(p, t):
    return np.mean([1 - scipy.stats.pearsonr(p[:, j], t[:, j])[0] for j in range(F)])


@pytest.mark.parametrize("scope", ["batch", "example"])
def test_eval_scope_exact_under_padding(tmp_path, scope):
    ev = tracks(n=13, seed=2)
    loss_fn = pearson_only if scope == "batch" else mean_ignoring_mask
    model = nn.Dense(F)
    res = jtrain.train(_cfg(data={"batch_size": 8, "model_inputs": ("x_data",)},
                            loss={"eval_scope": scope}),
                       str(tmp_path / scope), model=model, train_data=tracks(),
                       eval_data=ev, loss_fn=loss_fn)
    out = np.asarray(jtrain.to_model_fns(model).apply(res.state.params, ev["x_data"],
                                                      rng=None, train=False), np.float64)
    if scope == "batch":  # each eval batch's loss, weighted by its counted features
        want = (_np_pearson_loss(out[:8], ev["y_data"][:8]) * F
                + _np_pearson_loss(out[8:], ev["y_data"][8:]) * F) / (2 * F)
    else:
        want = np.mean((out - ev["y_data"]) ** 2)
    np.testing.assert_allclose(res.history[-1]["eval/loss"], want, rtol=1e-5)


TERMS = {
    "counts": {"fn": "mse", "output": "a", "target": "y_data", "weights": "x_avail",
               "weight": 1.0},
    "corr": {"fn": "pearson", "output": "b", "target": "x_data", "weight": 0.5},
}


class TwoHeads(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        h = nn.relu(nn.Dense(16)(x))
        return {"a": nn.Dense(F)(h), "b": nn.Dense(F)(h)}


@pytest.mark.slow  # seconds of CPU: the full suite runs it (tests/README.md)
def test_loss_terms_from_config_logged_and_exact(tmp_path):
    ev = tracks(n=13, seed=3)
    res = jtrain.train(_cfg(data={"batch_size": 8, "model_inputs": ("x_data",)},
                            loss={"terms": TERMS}),
                       str(tmp_path / "r"), model=TwoHeads(), train_data=tracks(),
                       eval_data=ev)
    rows = [json.loads(line) for line in open(tmp_path / "r" / "metrics.jsonl")]
    train_rows = [r for r in rows if "train/counts" in r]
    assert len(train_rows) == 4 and all("train/corr" in r for r in train_rows)
    m = res.history[-1]
    out = jtrain.to_model_fns(TwoHeads()).apply(res.state.params, ev["x_data"], rng=None,
                                                train=False)
    a, b = (np.asarray(out[k], np.float64) for k in "ab")
    keep = ev["x_avail"] > 0
    counts = np.mean(((a - ev["y_data"]) ** 2)[keep])
    np.testing.assert_allclose(m["eval/counts"], counts, rtol=1e-5)
    corr = (_np_pearson_loss(b[:8], ev["x_data"][:8]) + _np_pearson_loss(
        b[8:], ev["x_data"][8:])) / 2
    np.testing.assert_allclose(m["eval/corr"], corr, rtol=1e-5)
    # The loss: per batch, 1.0 x its counts mean + 0.5 x its corr mean, weighted by rows.
    per_batch = []
    for sl in (slice(0, 8), slice(8, 13)):
        k = keep[sl]
        c = np.mean(((a[sl] - ev["y_data"][sl]) ** 2)[k])
        per_batch.append(c + 0.5 * _np_pearson_loss(b[sl], ev["x_data"][sl]))
    np.testing.assert_allclose(m["eval/loss"], (per_batch[0] * 8 + per_batch[1] * 5) / 13,
                               rtol=1e-5)


@pytest.mark.parametrize("terms,key", [
    ({"x": {"fn": "msee"}}, "loss.terms.x.fn: unknown loss 'msee'"),
    ({"x": {"fn": "mse", "wieght": 1}}, "loss.terms.x.wieght: unknown key"),
    ({"x": {"fn": "mse", "weight": -1}}, "loss.terms.x.weight: must be a number >= 0"),
    ({"x": {"fn": "mse", "output": "zz"}}, "loss.terms.x.output: output 'zz' not found"),
    ({"x": {"fn": "mse", "output": "a", "target": "nope"}},
     "loss.terms.x.target: batch field 'nope' not found"),
])
def test_bad_loss_terms_are_one_line(tmp_path, terms, key):
    with pytest.raises(ConfigError) as e:
        jtrain.train(_cfg(data={"batch_size": 8, "model_inputs": ("x_data",)},
                          loss={"terms": terms}),
                     str(tmp_path / "r"), model=TwoHeads(), train_data=tracks())
    assert key in str(e.value) and "\n" not in str(e.value), str(e.value)


USER_MODULE = '''
import flax.linen as nn
import jax.numpy as jnp
import numpy as np

F = 6


def tracks(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.poisson(3.0, size=(n, F)).astype(np.float32)
    return {"x_data": x, "x_avail": (rng.random((n, F)) > 0.2).astype(np.float32),
            "y_data": x * 1.5 + 1.0}


def make_data():
    return {"train": tracks(48, 0), "eval": tracks(13, 1)}


class Imputer(nn.Module):
    width: int = 16

    @nn.compact
    def __call__(self, batch, train=False):
        h = nn.relu(nn.Dense(self.width)(batch["x_data"] * batch["x_avail"]))
        return {"nb": {"mean": nn.softplus(nn.Dense(F)(h)) + 1e-3,
                       "dispersion": nn.softplus(nn.Dense(F)(h)) + 1e-3},
                "latent": nn.Dense(F)(h)}


def make_model(width=16):
    return Imputer(width=width)


def predict(outputs, batch):
    return outputs["nb"]["mean"], batch["y_data"], batch["x_avail"]
'''

CONFIG = '''
import jtrain


def get_config():
    c = jtrain.defaults("user")
    c.model.factory = "imputer:make_model"
    c.model.kwargs = {"width": 8}
    c.data.source = "imputer:make_data"
    c.data.batch_size = 8
    c.total_steps = 4
    c.eval.every_steps = 2
    c.eval.predict_fn = "imputer:predict"
    c.loss.terms = {
        "nb": {"fn": "negative_binomial", "output": "nb", "target": "y_data",
               "weights": "x_avail"},
        "corr": {"fn": "pearson", "output": "latent", "target": "x_data", "weight": 0.1},
    }
    c.log.writers = ("jsonl",)
    return c
'''


def _run(tmp_path, *args):
    return run_python(tmp_path, "-m", *args)


def test_cli_user_batches_terms_and_predict_fn_then_evaluate(tmp_path):
    """A user's genomics-like run from the CLI: dict items without `inputs`, a
    multi-head model from model.factory, loss.terms with an availability mask and a
    correlation term, eval.predict_fn; then `jtrain.evaluate` of it from the CLI."""
    (tmp_path / "imputer.py").write_text(textwrap.dedent(USER_MODULE))
    (tmp_path / "cfg.py").write_text(textwrap.dedent(CONFIG))
    p = _run(tmp_path, "jtrain.main", "--config=cfg.py", "--workdir=runs/imp")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    seen = p.stdout + p.stderr
    assert "eval regression: loss, mse, mae, r2, pearson, spearman" in seen, seen[-3000:]
    eval_line = [ln for ln in seen.splitlines() if "eval at step 4" in ln][-1]
    for name in ("nb ", "corr ", "r2 ", "pearson ", "spearman "):
        assert name in eval_line, eval_line
    summary = json.loads((tmp_path / "runs/imp/summary.json").read_text())
    p = _run(tmp_path, "jtrain.evaluate", "--workdir=runs/imp", "--noplots")
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads((tmp_path / "runs/imp/eval_4.json").read_text())
    for k in ("eval/loss", "eval/nb", "eval/corr", "eval/r2", "eval/spearman"):
        np.testing.assert_allclose(report["metrics"][k], summary[k], rtol=1e-5, err_msg=k)
    # A typo in a term is one line from the CLI, exit 2.
    p = _run(tmp_path, "jtrain.main", "--config=cfg.py", "--workdir=runs/bad",
             "--config.loss.terms.nb.fn=negative_binomal")
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert "loss.terms.nb.fn: unknown loss 'negative_binomal'" in p.stderr, p.stderr[-2000:]
