"""Loss functions. A loss returns `(loss_sum, weight_sum)` so that averaging over
microbatches, devices and hosts is exact (token-weighted); a plain scalar (a mean) is
also accepted from user losses and then counts with weight 1.

Batch conventions (numpy dicts from jtrain.data):
  inputs   model input
  targets  int labels -> softmax cross-entropy over the last output axis;
           float targets -> mean squared error
  weights  optional loss weights per example [B], per token [B, T] or per element
           (the targets' shape); weight-0 elements count for nothing, even where the
           target is NaN or inf (a missing value)
Every other field is yours, whatever its name (`mask`, `valid`, ...): jtrain reads none
of them. The engine's own row mask of padded batches (0 = a padding row) travels under
`ROW_MASK`, a key no dataset may yield; `weights_for(batch, shape)` folds it in.

The building blocks for custom losses (`masked_cross_entropy`, `mse`, `mae`,
`binary_cross_entropy`, `negative_binomial_nll`, `gaussian_nll`, `poisson_nll`,
`pearson_loss`, `weighted`: pure jax.numpy, float32 math) take optional `weights`
(broadcast over trailing axes) and return `(loss_sum, weight_sum)`, weight-0 elements
counting for nothing in value and gradient; pass `weights=weights_for(batch, shape)` to
honour the batch's weights and row mask. terms.py: the loss a config names (loss.fn,
loss.terms: a weighted multi-loss).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import jax.scipy.special
import optax

__all__ = ["ROW_MASK", "binary_cross_entropy", "default_loss", "gaussian_nll", "mae",
           "masked_cross_entropy", "mse", "negative_binomial_nll", "pearson_loss",
           "poisson_nll", "weighted", "weights_for"]

# The engine's row mask of padded batches ([B] float32, 0 = padding), beside the user's
# fields: the data layer adds it, `jtrain.step` keeps it from the model, a dataset that
# yields this key is refused (`jtrain.data.items`).
ROW_MASK = "__jtrain_row_mask__"
"""The batch key of the engine's row mask ([B] float32, 0 = a padding row).

A loss of your own sees it in `batch` for padded eval batches (and train batches with
`data.drop_last=False`); `weights_for(batch, shape)` folds it into the weights.

Examples:
    ```python
    from jtrain import losses

    def loss_fn(outputs, batch):
        rows = batch.get(losses.ROW_MASK)     # None when no row is padding
        w = losses.weights_for(batch, outputs.shape[:1])   # includes the row mask
        return ((outputs[:, 0] - batch["targets"]) ** 2 * w).sum(), w.sum()
    ```
"""


def batch_rows(batch) -> int:
    """The number of rows of a batch (padding included)."""
    return jax.tree.leaves(batch)[0].shape[0]


def row_mask(batch):
    """The engine's [B] row mask of a batch, or None when no row is padding."""
    return batch.get(ROW_MASK) if isinstance(batch, dict) else None


def weights_for(batch, shape) -> jnp.ndarray:
    """Per-element weights of shape `shape`: `weights` (broadcast over trailing axes)
    times the engine's row mask.

    Examples:
        ```python
        import jax.numpy as jnp
        from jtrain import losses

        batch = {"targets": jnp.array([0, 1]), "weights": jnp.array([1.0, 0.0])}
        losses.weights_for(batch, (2,))           # [1., 0.]
        losses.weights_for(batch, (2, 5)).shape   # (2, 5): broadcast over the tokens
        ```
    """
    w = jnp.ones(shape, jnp.float32)
    if "weights" in batch:
        w = w * jnp.broadcast_to(_expand(batch["weights"], len(shape)), shape)
    rows = row_mask(batch)
    if rows is not None:
        w = w * _expand(rows, len(shape))
    return w


def _expand(x, ndim):
    x = jnp.asarray(x, jnp.float32)
    return x.reshape(x.shape + (1,) * (ndim - x.ndim))


def per_example_loss(outputs, targets) -> jnp.ndarray:
    """Cross-entropy for integer targets ([B] or [B, T]); squared error, averaged over
    the trailing feature axes, for float targets."""
    outputs = outputs.astype(jnp.float32)
    if jnp.issubdtype(targets.dtype, jnp.integer):
        return optax.softmax_cross_entropy_with_integer_labels(outputs, targets)
    diff = (outputs - targets.astype(jnp.float32)) ** 2  # [B, ...]
    return diff.reshape(diff.shape[0], -1).mean(axis=1)  # [B]


def default_loss(outputs, batch):
    """(weighted sum of the losses, sum of the weights): cross-entropy per example or
    token for integer targets; for float targets the squared error averaged over the
    trailing axes per example, or, with `weights` of more than one axis, per element
    (weights broadcast over the targets' trailing axes: an availability mask).
    Weight-0 elements are selected out, never multiplied: a NaN or inf target there
    (a missing value) adds exactly 0 to the loss and its gradient.

    Examples:
        ```python
        import jax.numpy as jnp
        from jtrain import losses

        logits = jnp.array([[2.0, 0.0], [0.0, 2.0]])
        losses.default_loss(logits, {"targets": jnp.array([0, 1])})    # (0.2539, 2.0): CE
        pred = jnp.array([[1.0], [3.0]])
        losses.default_loss(pred, {"targets": jnp.array([[1.0], [1.0]])})  # (4.0, 2.0): MSE

        def loss_fn(outputs, batch):              # a loss of your own around it
            loss_sum, weight = losses.default_loss(outputs["logits"], batch)
            return loss_sum, weight
        ```
    """
    targets = batch["targets"]
    if jnp.issubdtype(targets.dtype, jnp.integer):
        per = per_example_loss(outputs, targets)
        return _reduce(per, weights_for(batch, per.shape))
    targets = jnp.asarray(targets, jnp.float32)
    outputs = jnp.asarray(outputs, jnp.float32).reshape(targets.shape)
    per_element = "weights" in batch and jnp.ndim(batch["weights"]) > 1
    w = weights_for(batch, targets.shape if per_element else targets.shape[:1])
    per = (outputs - _kept(targets, _expand(w, targets.ndim))) ** 2
    if not per_element:
        per = per.reshape(per.shape[0], -1).mean(axis=1)  # [B]
    return _reduce(per, w)


def split_loss(result, rows=1):
    """A loss function's result as ((loss_sum, weight), {name: (sum, weight)}): the loss
    may be a scalar mean, a (sum, weight) pair, or either of those followed by a dict of
    named terms (`(loss, {"recon": ..., "kl": ...})`), each a scalar mean or a pair.
    A scalar mean counts with weight `rows` (the rows it averaged: means of batches of
    different sizes then average exactly). The terms are logged as train/<name> and
    eval/<name>; only the loss is optimized."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
        return (as_sum_and_weight(result[0], rows),
                {str(k): as_sum_and_weight(v, rows) for k, v in result[1].items()})
    return as_sum_and_weight(result, rows), {}


def as_sum_and_weight(result, rows=1):
    """Normalise a loss function's result to (loss_sum, weight_sum); a scalar mean
    counts with weight `rows`."""
    if isinstance(result, tuple):
        loss_sum, weight = result
        return jnp.asarray(loss_sum, jnp.float32), jnp.asarray(weight, jnp.float32)
    n = jnp.asarray(rows, jnp.float32)
    return jnp.asarray(result, jnp.float32) * n, n


def correct_count(outputs, batch):
    """(number correct, number counted) for classification-shaped outputs, else None."""
    targets = batch["targets"]
    if not jnp.issubdtype(targets.dtype, jnp.integer) or outputs.ndim != targets.ndim + 1:
        return None
    hits = (jnp.argmax(outputs, axis=-1) == targets).astype(jnp.float32)
    w = weights_for(batch, hits.shape)
    return (hits * w).sum(), w.sum()


# ---------------------------------------------------------------------------------------
# Building blocks: per-element losses reduced to (loss_sum, weight_sum).

def _weights(weights, shape) -> jnp.ndarray:
    """float32 weights of `shape`: ones, or `weights` broadcast over trailing axes."""
    if weights is None:
        return jnp.ones(shape, jnp.float32)
    return jnp.broadcast_to(_expand(weights, len(shape)), shape)


def _reduce(per, w):
    """(sum of per * w, sum of w) as float32; elements with w == 0 are dropped with
    `where`, so a NaN/inf loss in a padded element cannot leak into the sum."""
    per = per.astype(jnp.float32)
    return jnp.where(w != 0, per * w, 0.0).sum(), w.sum()


def _kept(x, w):
    """`x` where the weight is nonzero, 0 elsewhere: a NaN/inf target under weight 0
    (a missing value) then gives a finite loss *and* gradient there (a `where` on the
    loss alone still sends NaN through the gradient of the unselected branch)."""
    return jnp.where(w != 0, x, 0.0)


def weighted(per_element, batch):
    """(sum, weight) of a per-element loss under the batch's `weights` and row `mask`.

    Examples:
        ```python
        import jax.numpy as jnp
        from jtrain import losses

        batch = {"targets": jnp.array([0, 1]), "weights": jnp.array([1.0, 0.0])}
        losses.weighted(jnp.array([3.0, 5.0]), batch)    # (3.0, 1.0): the second row weighs 0

        def loss_fn(outputs, batch):
            return losses.weighted(jnp.abs(outputs - batch["targets"]), batch)
        ```
    """
    per_element = jnp.asarray(per_element)
    return _reduce(per_element, weights_for(batch, per_element.shape))


def masked_cross_entropy(logits, labels, weights=None, ignore_index=-100):
    """Softmax CE of logits [..., C] against int labels [...]; labels == ignore_index
    and weight-0 elements do not count (torch F.cross_entropy with ignore_index).

    Examples:
        ```python
        import jax.numpy as jnp
        from jtrain import losses

        logits = jnp.array([[2.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
        labels = jnp.array([0, 1, -100])                 # -100: not counted
        loss_sum, n = losses.masked_cross_entropy(logits, labels)   # (0.2539, 2.0)
        mean = loss_sum / n
        ```
    """
    logits = jnp.asarray(logits).astype(jnp.float32)
    labels = jnp.asarray(labels)
    valid = labels != ignore_index
    safe = jnp.where(valid, labels, 0).astype(jnp.int32)
    picked = jnp.take_along_axis(logits, safe[..., None], axis=-1)[..., 0]
    per = jax.nn.logsumexp(logits, axis=-1) - picked
    w = jnp.where(valid, _weights(weights, labels.shape), 0.0)
    return _reduce(per, w)


def _pair(a, b):
    a = jnp.asarray(a).astype(jnp.float32)
    b = jnp.asarray(b).astype(jnp.float32)
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    return jnp.broadcast_to(a, shape), jnp.broadcast_to(b, shape)


def mse(pred, target, weights=None):
    """Mean squared error per element; weight = sum of the (broadcast) element weights.

    Examples:
        ```python
        import jax.numpy as jnp
        from jtrain import losses

        pred, target = jnp.array([1.0, 2.0, 4.0]), jnp.array([1.0, jnp.nan, 2.0])
        losses.mse(pred, target, weights=jnp.array([1.0, 0.0, 1.0]))   # (4.0, 2.0): NaN unseen

        def loss_fn(outputs, batch):
            return losses.mse(outputs, batch["targets"],
                              weights=losses.weights_for(batch, batch["targets"].shape))
        ```
    """
    pred, target = _pair(pred, target)
    w = _weights(weights, pred.shape)
    return _reduce((pred - _kept(target, w)) ** 2, w)


def mae(pred, target, weights=None):
    """Mean absolute error per element; weight = sum of the (broadcast) element weights.

    Examples:
        ```python
        import jax.numpy as jnp
        from jtrain import losses

        losses.mae(jnp.array([1.0, 2.0, 4.0]), jnp.array([1.0, 2.0, 2.0]))   # (2.0, 3.0)
        ```
    """
    pred, target = _pair(pred, target)
    w = _weights(weights, pred.shape)
    return _reduce(jnp.abs(pred - _kept(target, w)), w)


def binary_cross_entropy(logits, targets, weights=None):
    """Sigmoid CE on logits, stable for large |logits| (torch BCE-with-logits).

    Examples:
        ```python
        import jax.numpy as jnp
        from jtrain import losses

        logits, targets = jnp.array([0.0, 0.0]), jnp.array([1.0, 0.0])
        losses.binary_cross_entropy(logits, targets)    # (1.3863, 2.0): 2 x log 2
        ```
    """
    x, t = _pair(logits, targets)
    w = _weights(weights, x.shape)
    t = _kept(t, w)
    # -[t log s(x) + (1 - t) log(1 - s(x))] = max(x, 0) - x t + log(1 + e^-|x|)
    per = jnp.maximum(x, 0.0) - x * t + jnp.log1p(jnp.exp(-jnp.abs(x)))
    return _reduce(per, w)


def negative_binomial_nll(counts, mean, dispersion, weights=None, eps=1e-8):
    """-log NB(counts; mean mu, inverse dispersion theta) with the lgamma terms, i.e.
    scipy nbinom.logpmf(x, n=theta, p=theta/(theta+mu)) negated (scVI log_nb_positive).

    Examples:
        ```python
        import jax.numpy as jnp
        from jtrain import losses

        counts = jnp.array([0.0, 3.0])
        mean, dispersion = jnp.array([1.0, 2.0]), jnp.array([2.0, 2.0])
        losses.negative_binomial_nll(counts, mean, dispersion)   # (2.8904, 2.0)
        ```
    """
    x = jnp.asarray(counts).astype(jnp.float32)
    mu = jnp.asarray(mean).astype(jnp.float32)
    theta = jnp.asarray(dispersion).astype(jnp.float32)
    shape = jnp.broadcast_shapes(x.shape, mu.shape, theta.shape)
    x, mu, theta = (jnp.broadcast_to(v, shape) for v in (x, mu, theta))
    w = _weights(weights, shape)
    x = _kept(x, w)
    # theta log(theta/(theta+mu)) + x log(mu/(theta+mu)) (eps as scVI puts it), as log1p
    # rather than a difference of logs; lgamma(x+theta) - lgamma(theta) - lgamma(x+1)
    # as -log(x+theta) - betaln(theta, x+1): both lose far less in float32
    log_lik = (-theta * jnp.log1p(mu / (theta + eps)) - x * jnp.log1p(theta / (mu + eps))
               - jnp.log(x + theta) - jax.scipy.special.betaln(theta, x + 1.0))
    return _reduce(-log_lik, w)


def _clamp_min_straight_through(v, lo):
    """max(v, lo) in value, identity in gradient (torch clamps var under no_grad)."""
    return v + jax.lax.stop_gradient(jnp.maximum(v, lo) - v)


def gaussian_nll(target, mean, var, weights=None, eps=1e-6, full=False):
    """0.5 (log var + (target - mean)^2 / var) per element, var clamped at eps, plus
    0.5 log(2 pi) if `full` (torch F.gaussian_nll_loss).

    Examples:
        ```python
        import jax.numpy as jnp
        from jtrain import losses

        target, mean, var = jnp.array([0.0, 1.0]), jnp.zeros(2), jnp.ones(2)
        losses.gaussian_nll(target, mean, var)    # (0.5, 2.0): 0.5 * (log var + (x - m)^2 / var)
        ```
    """
    target, mean = _pair(target, mean)
    var = jnp.asarray(var).astype(jnp.float32)
    if var.shape == target.shape[:-1]:  # torch: var may lack the last (feature) axis
        var = var[..., None]
    var = _clamp_min_straight_through(jnp.broadcast_to(var, target.shape), eps)
    w = _weights(weights, target.shape)
    per = 0.5 * (jnp.log(var) + (_kept(target, w) - mean) ** 2 / var)
    if full:
        per = per + 0.5 * math.log(2.0 * math.pi)
    return _reduce(per, w)


def poisson_nll(log_rate_or_rate, target, weights=None, log_input=True, full=False,
                eps=1e-8):
    """Poisson NLL without the log(target!) term, or with its Stirling approximation
    (target > 1) if `full` (torch F.poisson_nll_loss).

    Examples:
        ```python
        import jax.numpy as jnp
        from jtrain import losses

        log_rate, target = jnp.zeros(2), jnp.array([1.0, 2.0])
        losses.poisson_nll(log_rate, target)      # (2.0, 2.0): exp(log_rate) - target * log_rate
        ```
    """
    inp, t = _pair(log_rate_or_rate, target)
    w = _weights(weights, t.shape)
    t = _kept(t, w)
    per = jnp.exp(inp) - t * inp if log_input else inp - t * jnp.log(inp + eps)
    if full:
        safe_t = jnp.where(t > 1.0, t, 1.0)
        stirling = (safe_t * jnp.log(safe_t) - safe_t
                    + 0.5 * jnp.log(2.0 * math.pi * safe_t))
        per = per + jnp.where(t > 1.0, stirling, 0.0)
    return _reduce(per, w)


def pearson_loss(pred, target, weights=None, axis=0, eps=1e-8):
    """1 - Pearson r over the batch `axis`, per feature; (sum over features, n features).

    A batch-level loss: the means and sums run over the rows it is given, so it is
    exact only over the whole batch (with grad accumulation each microbatch is its own
    batch; jtrain's eval step runs a user loss one example at a time, where r is
    undefined). Rows with weight 0 (e.g. eval padding: pass weights_for(batch, shape))
    are excluded, whatever their values; non-binary weights weight the moments.
    Features whose weight total is 0 do not count. `eps` floors each standard deviation
    (a constant column gives r = 0).

    Examples:
        ```python
        import jax.numpy as jnp
        from jtrain import losses

        pred, target = jnp.array([1.0, 2.0, 3.0]), jnp.array([2.0, 4.0, 6.5])
        losses.pearson_loss(pred, target)         # (0.0021, 1.0): r = 0.998
        ```
    """
    p, t = _pair(pred, target)
    w = _weights(weights, p.shape)
    p, t, w = (jnp.moveaxis(v, axis, 0) for v in (p, t, w))
    keep = w != 0
    p, t = jnp.where(keep, p, 0.0), jnp.where(keep, t, 0.0)  # padding can hold NaN/inf
    total = w.sum(axis=0)
    denom = jnp.where(total > 0, total, 1.0)
    dp = jnp.where(keep, p - (w * p).sum(axis=0) / denom, 0.0)
    dt = jnp.where(keep, t - (w * t).sum(axis=0) / denom, 0.0)
    cov = (w * dp * dt).sum(axis=0) / denom
    std_p = jnp.sqrt(jnp.maximum((w * dp * dp).sum(axis=0) / denom, eps * eps))
    std_t = jnp.sqrt(jnp.maximum((w * dt * dt).sum(axis=0) / denom, eps * eps))
    r = cov / (std_p * std_t)
    counted = (total > 0).astype(jnp.float32)
    return jnp.where(total > 0, 1.0 - r, 0.0).sum(), counted.sum()
