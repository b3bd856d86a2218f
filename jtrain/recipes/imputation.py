"""Recipe: imputing missing genomic tracks (configs/recipes/imputation.py).

The data (`make_data`), generated from `seed`: S samples (cell types) x R regions, each
example one (sample, region) window of P positions x F features (FEATURES: 5 read-count
assays, then 3 -log10 p-value tracks). At each position K=3 latent factors
z = z_region + 0.7 * z_sample,region (both Gaussian noise smoothed over 5 positions and
rescaled to unit variance) drive every feature: counts ~ NB(exp(a_f + w_f.z), theta=5)
(a gamma-Poisson draw), p-values = c_f + v_f.z + N(0, 0.3^2). Each sample measured each
feature with probability 0.7 (`avail`); sample 0 measured none and sample 1 exactly one
(the edge cases). Metadata per example: `sample`, `region`, `start`. Regions [0, 0.8 R)
train (a torch IterableDataset, reshuffled per epoch), the rest eval, where `holdout`
marks the available features hidden from the model (fixed per example).

Training hides, per example and step, a random subset of the available features inside
the jitted step (keyed by the run's seed and the step, so an exact resume draws the same
masks): k = max(1, round(0.25 |A|)) of the |A| available ones, at most |A| - 1, so one
stays visible; |A| < 2 hides none. The model sees the visible tracks, their mask and
predicts NB (mean, dispersion) for counts and Gaussian (mean, var) for p-values at every
feature; the loss is NB NLL + Gaussian NLL on hidden ("imputed") entries plus half of it
on visible ("observed") entries, each logged (train/counts_imputed, ...).

`python -m jtrain.recipes.report RUN` prints R2, Pearson, Spearman and MSE per feature
(log1p counts, p-values) on the eval regions, observed vs imputed, the median over
features, and the mean-imputation baseline: a hidden feature at a position predicted by
the mean of the same feature in the other samples where it is visible.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jtrain import losses

FEATURES = ("H3K4me3", "H3K27ac", "H3K36me3", "H3K27me3", "ATAC",
            "pval_H3K4me3", "pval_H3K27ac", "pval_ATAC")
N_COUNTS, N_PVALS, K = 5, 3, 3
HIDE_FRACTION = 0.25


def _smooth(rng, shape):
    """Gaussian noise smoothed along axis -2 (positions) over 5, unit variance."""
    x = rng.normal(size=shape)
    kernel = np.ones(5) / 5
    x = np.apply_along_axis(lambda v: np.convolve(v, kernel, mode="same"), -2, x)
    return x / x.std()


def hide_count(n_avail):
    """How many of n available features to hide: max(1, round(0.25 n)), at most n - 1."""
    n = np.asarray(n_avail)
    k = np.maximum(1, np.round(HIDE_FRACTION * n))
    return np.where(n < 2, 0, np.minimum(k, n - 1)).astype(np.int32)


def generate(seed=0, samples=12, regions=60, positions=32):
    """Every (sample, region) window as arrays; see the module docstring."""
    rng = np.random.default_rng(seed)
    F = N_COUNTS + N_PVALS
    loadings = rng.normal(size=(F, K)) * 0.8
    bias = np.r_[rng.uniform(0.5, 2.0, N_COUNTS), rng.uniform(1.0, 3.0, N_PVALS)]
    z = (_smooth(rng, (1, regions, positions, K))
         + 0.7 * _smooth(rng, (samples, regions, positions, K)))    # [S, R, P, K]
    signal = z @ loadings.T + bias                                  # [S, R, P, F]
    mean = np.exp(signal[..., :N_COUNTS])
    theta = 5.0
    counts = rng.poisson(rng.gamma(theta, mean / theta)).astype(np.float32)
    pvals = (signal[..., N_COUNTS:] + rng.normal(0, 0.3, signal[..., N_COUNTS:].shape))
    avail = (rng.uniform(size=(samples, F)) < 0.7).astype(np.float32)
    avail[0] = 0.0                                  # a sample with no measured feature
    avail[1] = 0.0
    avail[1, rng.integers(F)] = 1.0                 # a sample with exactly one
    s, r = np.meshgrid(np.arange(samples), np.arange(regions), indexing="ij")
    return {"counts": counts.reshape(-1, positions, N_COUNTS),
            "pvals": pvals.astype(np.float32).reshape(-1, positions, N_PVALS),
            "avail": np.repeat(avail, regions, axis=0),
            "sample": s.reshape(-1).astype(np.int32), "region": r.reshape(-1).astype(np.int32),
            "start": (r.reshape(-1) * positions).astype(np.int32)}


def _holdout(avail, seed):
    """The eval set's hidden features: the training rule, drawn once per example."""
    rng = np.random.default_rng(seed + 1)
    order = np.argsort(np.where(avail > 0, rng.uniform(size=avail.shape), np.inf), axis=1)
    ranks = np.argsort(order, axis=1)
    return ((ranks < hide_count(avail.sum(1))[:, None]) & (avail > 0)).astype(np.float32)


def _take(arrays, idx):
    return {k: v[idx] for k, v in arrays.items()}


def _split(seed=0, samples=12, regions=60, positions=32):
    arrays = generate(seed, samples, regions, positions)
    arrays["holdout"] = np.zeros_like(arrays["avail"])
    is_train = arrays["region"] < int(0.8 * regions)
    train, evals = _take(arrays, is_train), _take(arrays, ~is_train)
    evals["holdout"] = _holdout(evals["avail"], seed)
    return train, evals


class _Tracks:
    """The training windows as a stream, in a fresh order per epoch (set_epoch)."""

    def __init__(self, arrays: dict, seed: int):
        self.arrays, self.seed, self.epoch = arrays, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        n = len(self.arrays["sample"])
        for i in np.random.default_rng([self.seed, self.epoch]).permutation(n):
            yield {k: v[i] for k, v in self.arrays.items()}


_TRACKS = []


def _tracks_class():
    """Tracks: _Tracks as a torch IterableDataset, torch imported on first use (a report
    of a finished run imports this module without needing torch)."""
    if not _TRACKS:
        try:
            from torch.utils.data import IterableDataset
        except ImportError:  # the recipe needs torch (pip install 'jtrain[recipes]')
            raise ImportError("the imputation recipe streams a torch IterableDataset: "
                              "pip install 'jtrain[recipes]'") from None
        _TRACKS.append(type("Tracks", (_Tracks, IterableDataset), {"__module__": __name__}))
    return _TRACKS[0]


def __getattr__(name):
    if name == "Tracks":
        return _tracks_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_data(seed=0, samples=12, regions=60, positions=32):
    """data.source: {"train": Tracks (IterableDataset), "eval": dict of arrays}."""
    tracks = _tracks_class()
    train, evals = _split(seed, samples, regions, positions)
    n_hidden = int(evals["holdout"].sum())
    print(f"recipe imputation: {len(train['sample'])} train windows (a torch "
          f"IterableDataset), {len(evals['sample'])} eval windows of {positions} positions "
          f"x {len(FEATURES)} features; {n_hidden} eval tracks hidden; per-step masking of "
          "available features in the step; NB + Gaussian NLL", flush=True)
    return {"train": tracks(train, seed), "eval": evals}


def hide_in_graph(key, avail):
    """[B, F] 0/1: a random subset of each row's available features (hide_count of them)."""
    u = jnp.where(avail > 0, jax.random.uniform(key, avail.shape), jnp.inf)
    ranks = jnp.argsort(jnp.argsort(u, axis=1), axis=1)
    n = avail.sum(1)
    k = jnp.where(n < 2, 0, jnp.minimum(jnp.maximum(1, jnp.round(HIDE_FRACTION * n)), n - 1))
    return ((ranks < k[:, None]) & (avail > 0)).astype(jnp.float32)


class Imputer(nn.Module):
    """Visible tracks + their mask -> per feature NB (counts) / Gaussian (p-values)."""
    width: int = 64
    layers: int = 2

    @nn.compact
    def __call__(self, batch, train: bool = False):
        avail = batch["avail"].astype(jnp.float32)                        # [B, F]
        hidden = (hide_in_graph(self.make_rng("dropout"), avail) if train
                  else batch["holdout"].astype(jnp.float32))
        visible = avail * (1.0 - hidden)
        x = jnp.concatenate([jnp.log1p(batch["counts"]), batch["pvals"]], -1)  # [B, P, F]
        x = x * visible[:, None, :]
        h = jnp.concatenate([x, jnp.broadcast_to(visible[:, None, :], x.shape)], -1)
        h = nn.gelu(nn.Dense(self.width)(h))                             # [B, P, W]
        for _ in range(self.layers):
            h = h + nn.gelu(nn.Conv(self.width, (5,))(h))
        out = nn.Dense(2 * len(FEATURES))(h)                             # [B, P, 2F]
        F = len(FEATURES)
        log_theta = self.param("log_dispersion", nn.initializers.zeros, (N_COUNTS,))
        return {"nb": {"mean": jnp.exp(jnp.clip(out[..., :N_COUNTS], -10, 10)),
                       "dispersion": jnp.exp(log_theta) * jnp.ones_like(out[..., :N_COUNTS])},
                "gauss": {"mean": out[..., N_COUNTS:F],
                          "var": jnp.exp(jnp.clip(out[..., F + N_COUNTS:], -6, 6))},
                "hidden": hidden, "visible": visible}


def make_model(width=64, layers=2):
    """model.factory."""
    return Imputer(width=width, layers=layers)


def loss(outputs, batch):
    """loss.fn: imputed + 0.5 observed, NB NLL on counts and Gaussian NLL on p-values."""
    rows = losses.weights_for(batch, outputs["hidden"].shape[:1])  # the row mask
    P = batch["counts"].shape[1]
    terms = {}
    for kind, w_feat in (("imputed", outputs["hidden"]), ("observed", outputs["visible"])):
        w = jnp.broadcast_to((w_feat * rows[:, None])[:, None, :], (len(rows), P, len(FEATURES)))
        terms[f"counts_{kind}"] = losses.negative_binomial_nll(
            batch["counts"], outputs["nb"]["mean"], outputs["nb"]["dispersion"],
            weights=w[..., :N_COUNTS])
        terms[f"pvals_{kind}"] = losses.gaussian_nll(
            batch["pvals"], outputs["gauss"]["mean"], outputs["gauss"]["var"],
            weights=w[..., N_COUNTS:])
    total = 0.0
    for name, (s, n) in terms.items():
        total = total + (0.5 if name.endswith("observed") else 1.0) * s / jnp.maximum(n, 1e-12)
    return (total * rows.sum(), rows.sum()), terms


def predict(outputs, batch):
    """eval.predict_fn: the imputed entries, log1p counts and p-values (pooled)."""
    pred, target = predictions(outputs, batch)
    weights = jnp.broadcast_to(outputs["hidden"][:, None, :], pred.shape)
    return pred, target, weights


def predictions(outputs, batch):
    """([B, P, F] predicted, [B, P, F] measured): log1p counts, then p-values."""
    pred = jnp.concatenate([jnp.log1p(outputs["nb"]["mean"]), outputs["gauss"]["mean"]], -1)
    target = jnp.concatenate([jnp.log1p(batch["counts"]), batch["pvals"]], -1)
    return pred, target


def _metrics(pred, target):
    """R2, Pearson, Spearman, MSE of two 1-D arrays (nan when fewer than 3 entries)."""
    from scipy import stats

    if len(pred) < 3 or np.std(pred) == 0 or np.std(target) == 0:
        return {"r2": np.nan, "pearson": np.nan, "spearman": np.nan,
                "mse": float(np.mean((pred - target) ** 2)) if len(pred) else np.nan}
    sse, sst = np.sum((pred - target) ** 2), np.sum((target - target.mean()) ** 2)
    return {"r2": float(1 - sse / sst), "pearson": float(stats.pearsonr(pred, target)[0]),
            "spearman": float(stats.spearmanr(pred, target)[0]),
            "mse": float(np.mean((pred - target) ** 2))}


def baseline(evals):
    """Mean imputation: feature f of (sample s, region r) at each position = the mean of
    f over the other samples of region r where f is visible. [N, P, F]."""
    values = np.concatenate([np.log1p(evals["counts"]), evals["pvals"]], -1)   # [N, P, F]
    visible = evals["avail"] * (1 - evals["holdout"])                          # [N, F]
    out = np.zeros_like(values)
    for r in np.unique(evals["region"]):
        idx = np.flatnonzero(evals["region"] == r)
        total = (values[idx] * visible[idx, None, :]).sum(0)                   # [P, F]
        count = visible[idx].sum(0)                                            # [F]
        for i in idx:
            own = values[i] * visible[i]
            n = count - visible[i]
            out[i] = np.where(n > 0, (total - own) / np.maximum(n, 1), 0.0)
    return out


def report(params: dict, config: dict) -> dict:
    """The stated result: per-feature metrics on the eval regions (median over features),
    observed vs imputed, and the mean-imputation baseline on the same imputed entries."""
    _, evals = _split(**config["data"]["kwargs"])
    model = make_model(**config["model"]["kwargs"])
    outputs = model.apply({"params": params}, {k: jnp.asarray(v) for k, v in evals.items()})
    pred, target = (np.asarray(a) for a in predictions(outputs, evals))
    base = baseline(evals)
    groups = {"observed": evals["avail"] * (1 - evals["holdout"]), "imputed": evals["holdout"]}
    table = {}
    for name, sel in [("model observed", groups["observed"]), ("model imputed", groups["imputed"]),
                      ("mean-imputation imputed", groups["imputed"])]:
        p = base if name.startswith("mean") else pred
        per = [_metrics(p[sel[:, f] > 0, :, f].ravel(), target[sel[:, f] > 0, :, f].ravel())
               for f in range(len(FEATURES))]
        table[name] = {m: float(np.nanmedian([x[m] for x in per])) for m in per[0]}
    print(f"{'eval regions, median over features':36s} {'R2':>7s} {'Pearson':>8s} "
          f"{'Spearman':>9s} {'MSE':>7s}")
    for name, m in table.items():
        print(f"{name:36s} {m['r2']:7.3f} {m['pearson']:8.3f} {m['spearman']:9.3f} "
              f"{m['mse']:7.3f}")
    ours, base_r = table["model imputed"]["pearson"], table["mean-imputation imputed"]["pearson"]
    verdict = "above" if ours > base_r else "NOT above"
    print(f"result: imputed-feature Pearson {ours:.3f} vs mean-imputation baseline "
          f"{base_r:.3f} ({verdict} the baseline)")
    return {"table": table, "imputed_pearson": ours, "baseline_pearson": base_r}
