"""jtrain.losses building blocks against float64 references (torch.nn.functional, scipy):
`sum / weight` must equal the reference mean to 1e-6; weight-0 rows/elements (padding,
ignore_index) must change nothing; every function must jit."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import torch
import torch.nn.functional as F

from jtrain import losses

TOL = dict(rtol=1e-6, atol=1e-6)


_JIT = {}


def _jit(fn, **kw):
    """fn under jax.jit with its keyword options fixed (cached: one trace per shape)."""
    key = (fn.__name__, tuple(sorted(kw.items())))
    if key not in _JIT:
        _JIT[key] = jax.jit(lambda *a: fn(*a, **kw))
    return _JIT[key]


class _Jitted:
    """L.name(*arrays, **options) == jax.jit(losses.name)(*arrays) with static options."""

    def __getattr__(self, name):
        fn = getattr(losses, name)
        return lambda *a, **kw: _jit(fn, **kw)(*a)


L = _Jitted()
_weights_for = jax.jit(losses.weights_for, static_argnums=1)


def _rng(seed=0):
    return np.random.default_rng(seed)


def _t(x):
    """float64 torch tensor of the exact float32 (or int) values given to jax."""
    x = np.asarray(x)
    return torch.from_numpy(x.astype(np.float64) if x.dtype.kind == "f" else x.astype(np.int64))


def _mean(result):
    s, w = result
    assert s.dtype == jnp.float32 and w.dtype == jnp.float32 and s.shape == w.shape == ()
    return float(s) / float(w)


def _close(got, want):
    np.testing.assert_allclose(got, want, **TOL)


# ---- inputs shared by the per-function and the generic (padding, jit) tests -------------

def _cases():
    r = _rng(1)
    B, F_ = 12, 5

    def f32(*s, lo=-3.0, hi=3.0):
        return r.uniform(lo, hi, s).astype(np.float32)

    counts = r.poisson(4.0, (B, F_)).astype(np.float32)
    return {
        "masked_cross_entropy": (losses.masked_cross_entropy,
                                 (f32(B, F_, 7), r.integers(0, 7, (B, F_)).astype(np.int32)), {}),
        "mse": (losses.mse, (f32(B, F_), f32(B, F_)), {}),
        "mae": (losses.mae, (f32(B, F_), f32(B, F_)), {}),
        "binary_cross_entropy": (losses.binary_cross_entropy,
                                 (f32(B, F_), r.uniform(0, 1, (B, F_)).astype(np.float32)), {}),
        "negative_binomial_nll": (losses.negative_binomial_nll,
                                  (counts, f32(B, F_, lo=0.5, hi=8.0), f32(B, F_, lo=0.5, hi=5.0)),
                                  {}),
        "gaussian_nll": (losses.gaussian_nll,
                         (f32(B, F_), f32(B, F_), f32(B, F_, lo=0.1, hi=2.0)), {"full": True}),
        "poisson_nll": (losses.poisson_nll, (f32(B, F_, lo=-1.0, hi=2.0), counts), {"full": True}),
        "pearson_loss": (losses.pearson_loss, (f32(B, F_), f32(B, F_)), {}),
    }


CASES = _cases()


# ---- references -----------------------------------------------------------------------

def test_masked_cross_entropy_matches_torch_with_ignore_index():
    r = _rng(2)
    logits = r.normal(0, 3, (6, 9, 11)).astype(np.float32)
    labels = r.integers(0, 11, (6, 9)).astype(np.int32)
    labels[r.uniform(size=labels.shape) < 0.3] = -100
    want = F.cross_entropy(_t(logits).reshape(-1, 11), _t(labels).reshape(-1),
                           ignore_index=-100, reduction="mean").item()
    s, w = L.masked_cross_entropy(logits, labels)
    _close(float(s) / float(w), want)
    assert float(w) == (labels != -100).sum()


def test_masked_cross_entropy_weights_and_custom_ignore_index():
    r = _rng(3)
    logits = r.normal(0, 2, (8, 5, 4)).astype(np.float32)
    labels = r.integers(0, 4, (8, 5)).astype(np.int32)
    labels[0, :2] = 99  # ignored, and out of range: must not be gathered
    weights = r.uniform(0.5, 2.0, (8,)).astype(np.float32)
    weights[3] = 0.0
    safe = _t(np.where(labels == 99, 0, labels)).reshape(-1)
    per = F.cross_entropy(_t(logits).reshape(-1, 4), safe, reduction="none").reshape(8, 5).numpy()
    w = np.where(labels == 99, 0.0, weights[:, None].astype(np.float64))
    got = L.masked_cross_entropy(logits, labels, weights, ignore_index=99)
    _close(_mean(got), (per * w).sum() / w.sum())
    _close(float(got[1]), w.sum())


def test_mse_mae_match_torch_and_weights_broadcast():
    r = _rng(4)
    pred, target = (r.normal(0, 2, (10, 3, 4)).astype(np.float32) for _ in range(2))
    _close(_mean(L.mse(pred, target)), F.mse_loss(_t(pred), _t(target)).item())
    _close(_mean(L.mae(pred, target)), F.l1_loss(_t(pred), _t(target)).item())
    w = r.uniform(0, 2, (10,)).astype(np.float32)
    wb = np.broadcast_to(w[:, None, None].astype(np.float64), pred.shape)
    d = pred.astype(np.float64) - target
    s, tot = L.mse(pred, target, w)
    _close(float(s) / float(tot), (wb * d ** 2).sum() / wb.sum())
    _close(float(tot), wb.sum())  # count-weight: 12 elements per row
    _close(_mean(L.mae(pred, target, w)), (wb * np.abs(d)).sum() / wb.sum())


def test_binary_cross_entropy_matches_torch_and_is_stable():
    r = _rng(5)
    logits = r.normal(0, 4, (64, 3)).astype(np.float32)
    logits[0] = [80.0, -80.0, 0.0]  # exp overflow territory for a naive sigmoid/log
    targets = r.uniform(0, 1, (64, 3)).astype(np.float32)
    targets[1] = [0.0, 1.0, 1.0]
    want = F.binary_cross_entropy_with_logits(_t(logits), _t(targets)).item()
    _close(_mean(L.binary_cross_entropy(logits, targets)), want)


def test_negative_binomial_nll_matches_scipy_nbinom():
    r = _rng(6)
    mu = r.uniform(0.05, 30.0, (200, 3)).astype(np.float32)
    theta = r.uniform(0.2, 20.0, (200, 3)).astype(np.float32)
    x = r.negative_binomial(theta.astype(np.float64), theta / (theta + mu.astype(np.float64)))
    x = x.astype(np.float32)
    m64, t64 = mu.astype(np.float64), theta.astype(np.float64)
    logpmf = scipy.stats.nbinom.logpmf(x.astype(np.float64), n=t64, p=t64 / (t64 + m64))
    _close(_mean(L.negative_binomial_nll(x, mu, theta, eps=0.0)), -logpmf.mean())
    # default eps=1e-8 moves it by ~1e-8 relative only
    _close(_mean(L.negative_binomial_nll(x, mu, theta)), -logpmf.mean())
    # per-row weights broadcast over the genes
    w = r.uniform(0, 1, (200,)).astype(np.float32)
    wb = np.broadcast_to(w[:, None].astype(np.float64), x.shape)
    _close(_mean(L.negative_binomial_nll(x, mu, theta, w)), -(wb * logpmf).sum() / wb.sum())


@pytest.mark.parametrize("full", [False, True])
def test_gaussian_nll_matches_torch(full):
    r = _rng(7)
    mean, target = (r.normal(0, 1, (16, 6)).astype(np.float32) for _ in range(2))
    var = r.uniform(0.01, 3.0, (16, 6)).astype(np.float32)
    var[0, :3] = [0.0, 1e-9, 2e-7]  # clamped at eps
    want = F.gaussian_nll_loss(_t(mean), _t(target), _t(var), full=full, eps=1e-6).item()
    _close(_mean(L.gaussian_nll(target, mean, var, full=full)), want)
    var_row = var[:, 0].copy()  # torch also takes var without the last axis
    want = F.gaussian_nll_loss(_t(mean), _t(target), _t(var_row), full=full).item()
    _close(_mean(L.gaussian_nll(target, mean, var_row, full=full)), want)


def test_gaussian_nll_gradient_matches_torch_clamp():
    r = _rng(8)
    mean, target = (r.normal(0, 1, (8, 3)).astype(np.float32) for _ in range(2))
    var = r.uniform(0.5, 2.0, (8, 3)).astype(np.float32)
    var[0, 0] = 1e-8  # below eps: torch clamps the value but passes the gradient through
    tv = _t(var).requires_grad_(True)
    F.gaussian_nll_loss(_t(mean), _t(target), tv).backward()
    g = jax.grad(lambda v: _ratio(L.gaussian_nll(target, mean, v)))(jnp.asarray(var))
    np.testing.assert_allclose(np.asarray(g), tv.grad.numpy(), rtol=1e-5, atol=1e-6)


def _ratio(result):
    return result[0] / result[1]


@pytest.mark.parametrize("log_input", [True, False])
@pytest.mark.parametrize("full", [False, True])
def test_poisson_nll_matches_torch(log_input, full):
    r = _rng(9)
    target = r.poisson(3.0, (40, 4)).astype(np.float32)
    inp = (r.normal(0.5, 0.8, (40, 4)) if log_input else r.uniform(0.0, 6.0, (40, 4)))
    inp = inp.astype(np.float32)
    if not log_input:
        inp[0, 0] = 0.0  # log(0 + eps)
    want = F.poisson_nll_loss(_t(inp), _t(target), log_input=log_input, full=full,
                              eps=1e-8).item()
    got = _mean(L.poisson_nll(inp, target, log_input=log_input, full=full))
    _close(got, want)


def test_pearson_loss_matches_scipy_and_axis():
    r = _rng(10)
    pred = r.normal(0, 1, (50, 4)).astype(np.float32)
    target = (0.6 * pred + r.normal(0, 1, (50, 4))).astype(np.float32)
    rs = [scipy.stats.pearsonr(pred[:, j].astype(np.float64), target[:, j]).statistic
          for j in range(4)]
    s, w = L.pearson_loss(pred, target)
    _close(float(s), sum(1 - x for x in rs))
    assert float(w) == 4.0
    s_t, w_t = L.pearson_loss(pred.T, target.T, axis=1)  # batch along axis 1
    _close(float(s_t), float(s))
    assert float(w_t) == 4.0
    # [B, T, C]: features are all the trailing axes
    p3, t3 = pred.reshape(50, 2, 2), target.reshape(50, 2, 2)
    _close(_mean(L.pearson_loss(p3, t3)), np.mean([1 - x for x in rs]))


def test_pearson_loss_padding_and_weights():
    r = _rng(11)
    pred = r.normal(0, 1, (30, 3)).astype(np.float32)
    target = (pred + r.normal(0, 1, (30, 3))).astype(np.float32)
    ones = np.ones_like(pred)
    clean = L.pearson_loss(pred, target, ones)
    garbage = np.full((6, 3), 1e6, np.float32)
    garbage[0, 0], garbage[1, 1] = np.nan, np.inf
    batch = {"inputs": None, losses.ROW_MASK: np.r_[np.ones(30), np.zeros(6)].astype(np.float32)}
    pp, tt = np.concatenate([pred, garbage]), np.concatenate([target, -garbage])
    padded = L.pearson_loss(pp, tt, _weights_for(batch, pp.shape))
    _close(float(padded[0]), float(clean[0]))
    assert float(padded[1]) == float(clean[1]) == 3.0
    # an all-padding batch contributes nothing
    empty = L.pearson_loss(pp, tt, np.zeros_like(pp))
    assert float(empty[0]) == 0.0 and float(empty[1]) == 0.0
    # integer row weights == repeated rows (36 rows in all, shapes shared with the above)
    k = np.r_[np.full(6, 2), np.ones(24)].astype(np.int64)
    rep = L.pearson_loss(np.repeat(pred, k, 0), np.repeat(target, k, 0), np.ones_like(pp))
    kw = np.broadcast_to(k[:, None], pred.shape).astype(np.float32)
    _close(float(L.pearson_loss(pred, target, kw)[0]), float(rep[0]))
    # a constant column: finite, r = 0, so its loss is 1
    const_pred = pred.copy()
    const_pred[:, 0] = 2.5
    const = L.pearson_loss(const_pred, target, ones)
    rest = L.pearson_loss(const_pred[:, 1:], target[:, 1:])
    _close(float(const[0]), 1.0 + float(rest[0]))


# ---- generic: weight-0 rows change nothing, weighted(), jit ---------------------------

@pytest.mark.parametrize("name", sorted(CASES))
def test_weight_zero_row_changes_nothing(name):
    _, args, kw = CASES[name]
    fn = getattr(L, name)
    base = fn(*args, **kw)
    # append 3 garbage rows (NaN/inf/huge; labels out of range) with weight 0
    padded = []
    for a in args:
        extra = np.full((3,) + a.shape[1:], 7, a.dtype)
        if a.dtype.kind == "f":
            extra.reshape(3, -1)[:, 0] = [np.nan, np.inf, 1e30]
        padded.append(np.concatenate([a, extra]))
    w = np.r_[np.ones(len(args[0])), np.zeros(3)].astype(np.float32)
    got = fn(*padded, w, **kw)
    _close(float(got[0]), float(base[0]))
    assert float(got[1]) == float(base[1])
    # same through a batch's row mask
    batch = {"inputs": None, losses.ROW_MASK: w}
    shape = padded[1].shape if name == "masked_cross_entropy" else padded[0].shape
    got = fn(*padded, _weights_for(batch, shape), **kw)
    _close(float(got[0]), float(base[0]))


def test_weighted_uses_batch_weights_and_mask():
    per = np.array([[1.0, 2.0], [3.0, np.nan], [5.0, 6.0]], np.float32)
    batch = {"inputs": None, "weights": np.array([[1, 1], [1, 0], [2, 2]], np.float32),
             losses.ROW_MASK: np.array([1, 1, 0], np.float32)}
    s, w = L.weighted(per, batch)
    assert float(s) == 6.0 and float(w) == 3.0


@pytest.mark.parametrize("name", sorted(CASES))
def test_jit(name):
    """Traceable with abstract inputs (no Python branching on values) into float32
    scalars, and finite under jax.jit with fractional row weights. (Every reference test
    above also runs the functions through jax.jit.)"""
    fn, args, kw = CASES[name]
    w = np.linspace(0, 1, len(args[0])).astype(np.float32)
    f = jax.jit(lambda *a: fn(*a, **kw))
    shapes = jax.eval_shape(f, *args, w)
    assert [(x.shape, x.dtype) for x in shapes] == [((), jnp.float32)] * 2
    for x in f(*args, w):
        assert math.isfinite(float(x))
