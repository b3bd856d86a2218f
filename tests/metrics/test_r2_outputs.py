"""eval/r2 with several outputs is scikit-learn's default r2_score (the per-output R²
averaged uniformly), not R² of the outputs pooled into one; exact across batches with a
padded last batch, and across merged parts (devices, hosts); one output as before."""

import json
import math

import jax
import numpy as np
import pytest
from sklearn.metrics import r2_score

from journey import run_python

import jtrain.metrics as M


def data(n=100, seed=0):
    """3 outputs on different scales around different means (where pooling differs)."""
    rng = np.random.default_rng(seed)
    y = (rng.normal(size=(n, 3)) * [1.0, 0.3, 3.0] + [0.0, 5.0, -2.0]).astype(np.float32)
    p = (y + rng.normal(size=(n, 3)) * [0.5, 0.2, 1.0]).astype(np.float32)
    return p, y


def padded_batches(p, y, batch_size, garbage=np.nan):
    """The eval loop's batches: the last one padded with `garbage` rows, mask 0."""
    for start in range(0, len(y), batch_size):
        real = min(batch_size, len(y) - start)
        pad = ((0, batch_size - real),) + ((0, 0),) * (y.ndim - 1)
        yield {"preds": np.pad(p[start:start + real], pad, constant_values=garbage),
               "labels": np.pad(y[start:start + real], pad, constant_values=garbage),
               "mask": np.arange(batch_size) < real}


def r2_over(p, y, batch_size, num_outputs):
    """As jtrain's eval: one jitted batch state each, merged on the host in float64."""
    empty = M.R2.empty(num_outputs)
    step = jax.jit(lambda b: empty.update(**b))
    total = empty
    for batch in padded_batches(p, y, batch_size):
        total = total.merge(step(batch))
    return total


def reference(p, y, **kw):
    return r2_score(y.astype(np.float64), p.astype(np.float64), **kw)


def test_three_outputs_match_sklearn_default_with_a_padded_last_batch():
    p, y = data(100)  # batches of 32: the last holds 4 real rows and 28 NaN rows
    got = r2_over(p, y, 32, 3).compute()
    want = reference(p, y)
    assert want == pytest.approx(reference(p, y, multioutput="uniform_average"))
    assert got == pytest.approx(want, abs=1e-6)
    # Not the pooled number (nor sklearn's variance_weighted): they differ here.
    for other in (reference(p.ravel(), y.ravel()),
                  reference(p, y, multioutput="variance_weighted")):
        assert abs(other - want) > 0.01


def test_merging_parts_is_exact():
    """Two processes' (or devices') states merged give the whole set's R²."""
    p, y = data(157, seed=1)
    a, b = r2_over(p[:61], y[:61], 16, 3), r2_over(p[61:], y[61:], 16, 3)
    assert a.merge(b).compute() == pytest.approx(reference(p, y), abs=1e-6)
    assert b.merge(a).compute() == pytest.approx(a.merge(b).compute(), abs=1e-12)


def test_a_constant_output_follows_force_finite():
    p, y = data(50, seed=2)
    y[:, 1] = 2.5  # constant labels, imperfect predictions: that output scores 0.0
    assert r2_over(p, y, 16, 3).compute() == pytest.approx(reference(p, y), abs=1e-6)
    p[:, 1] = 2.5  # and perfect ones 1.0
    assert r2_over(p, y, 16, 3).compute() == pytest.approx(reference(p, y), abs=1e-6)


def test_one_output_unchanged():
    p, y = data(100, seed=3)
    p1, y1 = p[:, 2], y[:, 2]
    want = reference(p1, y1)
    assert r2_over(p1, y1, 32, 1).compute() == pytest.approx(want, abs=1e-6)
    assert r2_over(p1[:, None], y1[:, None], 32, 1).compute() == pytest.approx(want, abs=1e-6)
    assert math.isnan(r2_over(p1[:1], y1[:1], 32, 1).compute())  # fewer than 2 entries


def test_the_spec_sizes_r2_by_the_targets_last_axis():
    spec = M.EvalSpec.create((3,), (3,), np.float32)
    assert spec.num_outputs == 3 and spec.names[3] == "r2"
    assert M.make_collection(spec).metrics["r2"].num_outputs == 3
    assert M.EvalSpec.create((), (), np.float32).num_outputs == 1
    with pytest.raises(ValueError, match=r"R2\.empty\(num_outputs=3\) scores 3 outputs"):
        M.R2.empty().update(preds=np.zeros((4, 3)), labels=np.zeros((4, 3)))


SCRIPT = """\
import json

import jax.numpy as jnp
import numpy as np
from sklearn.metrics import r2_score

import jtrain

rng = np.random.default_rng(0)
x = rng.normal(size=(612, 5)).astype(np.float32)
w = rng.normal(size=(5, 3)).astype(np.float32)
y = (x @ w * np.float32([1.0, 0.3, 3.0]) + np.float32([0.0, 5.0, -2.0])
     + rng.normal(size=(612, 3)).astype(np.float32) * np.float32([0.5, 0.4, 1.0]))


def init(rng_key, inputs):
    return {"w": jnp.zeros((5, 3)), "b": jnp.zeros(3)}


def apply(params, inputs, rng=None, train=False):
    return inputs @ params["w"] + params["b"]


if __name__ == "__main__":
    config = {"total_steps": 300, "optim": {"lr": 0.1}, "data": {"batch_size": 32},
              "eval": {"batch_size": 32, "every_steps": 1000}, "log": {"writers": ("jsonl",)}}
    ev_x, ev_y = x[512:], y[512:]  # 100 rows: the last eval batch is 4 real, 28 padded
    result = jtrain.train(config, "runs/r2", model=(init, apply),
                          train_data={"inputs": x[:512], "targets": y[:512]},
                          eval_data={"inputs": ev_x, "targets": ev_y})
    p = np.asarray(apply(result.state.params, ev_x), np.float64)
    print(json.dumps({"eval/r2": result.summary["eval/r2"],
                      "sklearn": r2_score(ev_y.astype(np.float64), p),
                      "pooled": r2_score(ev_y.ravel().astype(np.float64), p.ravel())}))
"""


def test_a_run_reports_sklearn_r2_for_three_outputs(tmp_path):
    (tmp_path / "fit.py").write_text(SCRIPT)
    proc = run_python(tmp_path, "fit.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["eval/r2"] == pytest.approx(got["sklearn"], abs=1e-6)
    assert abs(got["pooled"] - got["sklearn"]) > 0.05
