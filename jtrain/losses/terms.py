"""The loss a config names: `loss.fn` (your function) or `loss.terms` (a weighted
multi-loss of jtrain's losses or yours), so the CLI, `python -m jtrain.evaluate` and
`jtrain.train` all score a run the same way.

    loss.terms = {
        "recon_rna": {"fn": "mse", "output": "rna", "target": "targets.rna", "weight": 1.0},
        "counts":    {"fn": "negative_binomial", "output": "nb", "target": "y_counts",
                      "weights": "y_avail"},
        "corr":      {"fn": "pearson", "output": "latent", "target": "z", "weight": 0.1},
    }

Per term: `fn` a built-in name (`TERM_FNS`) or "package.module:function" called as
`fn(prediction, target, weights, **kwargs)` returning a mean or `(sum, weight)`;
`output` the path of the prediction in the model's outputs ("" = the outputs
themselves, "a.b" = outputs["a"]["b"]); `target` the path in the batch ("targets" by
default); `weights` an optional batch path of per-element weights (an availability
mask); `weight` the term's factor; `kwargs` extra keyword arguments. Every term gets the
row mask of padded eval batches in its weights, so each term is exact under padding.

The optimised loss is sum_i weight_i * mean_i, counted per row of the batch (so
microbatches and eval batches of different sizes average exactly); each term is logged
as train/<name> and eval/<name> (its own weighted mean).
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from jtrain import losses
from jtrain.errors import ConfigError


def _nb(pred, target, weights, **kw):
    mean, dispersion = _pair(pred, ("mean", "dispersion"), "negative_binomial")
    return losses.negative_binomial_nll(target, mean, dispersion, weights=weights, **kw)


def _gaussian(pred, target, weights, **kw):
    mean, var = _pair(pred, ("mean", "var"), "gaussian")
    return losses.gaussian_nll(target, mean, var, weights=weights, **kw)


def _pair(pred, names, fn):
    if isinstance(pred, dict) and all(n in pred for n in names):
        return pred[names[0]], pred[names[1]]
    if isinstance(pred, (tuple, list)) and len(pred) == 2:
        return pred[0], pred[1]
    raise ConfigError("loss.terms", f"fn {fn!r} needs its output to be a dict with "
                                    f"{' and '.join(names)} (or a pair), got "
                                    f"{type(pred).__name__}")


def _ce(pred, target, weights, **kw):
    return losses.masked_cross_entropy(pred, target, weights=weights, **kw)


TERM_FNS: dict[str, Callable] = {
    "mse": lambda p, t, w, **kw: losses.mse(p, t, weights=w, **kw),
    "mae": lambda p, t, w, **kw: losses.mae(p, t, weights=w, **kw),
    "cross_entropy": _ce,
    "binary_cross_entropy": lambda p, t, w, **kw: losses.binary_cross_entropy(
        p, t, weights=w, **kw),
    "negative_binomial": _nb,
    "gaussian": _gaussian,
    "poisson": lambda p, t, w, **kw: losses.poisson_nll(p, t, weights=w, **kw),
    "pearson": lambda p, t, w, **kw: losses.pearson_loss(p, t, weights=w, **kw),
}
_TERM_KEYS = {"fn", "output", "target", "weights", "weight", "kwargs"}


def from_config(loss_cfg) -> tuple[Callable | None, bool]:
    """(loss_fn or None for the default loss, whether it is a loss.terms multi-loss)."""
    terms = loss_cfg.terms
    terms = terms.to_dict() if hasattr(terms, "to_dict") else dict(terms)
    if loss_cfg.fn and terms:
        raise ConfigError("loss.fn", "set loss.fn or loss.terms, not both")
    if loss_cfg.fn:
        from jtrain.config.named import load_named

        return load_named(loss_cfg.fn, "loss.fn", ConfigError), False
    if not terms:
        return None, False
    return make_multi_loss({name: _parse(name, spec) for name, spec in terms.items()}), True


def _parse(name: str, spec) -> dict:
    key = f"loss.terms.{name}"
    if not isinstance(spec, dict):
        raise ConfigError(key, f"must be a dict with fn, output, target, weight; got {spec!r}")
    unknown = sorted(set(spec) - _TERM_KEYS)
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}", f"unknown key; a term has "
                                                 f"{', '.join(sorted(_TERM_KEYS))}")
    fn_name = spec.get("fn")
    if not isinstance(fn_name, str) or not fn_name:
        raise ConfigError(f"{key}.fn", f"missing; one of {', '.join(TERM_FNS)} or "
                                       "'package.module:function'")
    if fn_name in TERM_FNS:
        fn = TERM_FNS[fn_name]
    elif ":" in fn_name:
        from jtrain.config.named import load_named

        fn = load_named(fn_name, f"{key}.fn", ConfigError)
    else:
        raise ConfigError(f"{key}.fn", f"unknown loss {fn_name!r}; one of "
                                       f"{', '.join(TERM_FNS)} or 'package.module:function'")
    weight = spec.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
        raise ConfigError(f"{key}.weight", f"must be a number >= 0, got {weight!r}")
    for field in ("output", "target", "weights"):
        if not isinstance(spec.get(field, ""), str):
            raise ConfigError(f"{key}.{field}", f"must be a path string like 'a.b', got "
                                                f"{spec[field]!r}")
    kwargs = spec.get("kwargs", {})
    if not isinstance(kwargs, dict):
        raise ConfigError(f"{key}.kwargs", f"must be a dict, got {kwargs!r}")
    return {"fn": fn, "output": spec.get("output", ""), "target": spec.get("target", "targets"),
            "weights": spec.get("weights", ""), "weight": float(weight), "kwargs": kwargs,
            "key": key}


def _get(tree, path: str, what: str, key: str):
    node = tree
    for part in [p for p in path.split(".") if p]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, (tuple, list)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            have = sorted(map(str, node)) if isinstance(node, dict) else type(node).__name__
            raise ConfigError(key, f"{what} {path!r} not found (at {part!r}; have {have})")
    return node


def make_multi_loss(terms: dict[str, dict]) -> Callable:
    """loss_fn(outputs, batch) -> ((sum, rows), {name: (sum, weight)}) for parsed terms."""

    def loss_fn(outputs, batch):
        rows = losses.row_mask(batch)
        rows = None if rows is None else jnp.asarray(rows, jnp.float32)
        total, named = 0.0, {}
        for name, t in terms.items():
            pred = _get(outputs, t["output"], "output", t["key"] + ".output")
            target = _get(batch, t["target"], "batch field", t["key"] + ".target")
            shape = jnp.shape(target)
            w = jnp.ones(shape, jnp.float32)
            if t["weights"]:
                wf = jnp.asarray(_get(batch, t["weights"], "batch field",
                                      t["key"] + ".weights"), jnp.float32)
                w = w * wf.reshape(wf.shape + (1,) * (len(shape) - wf.ndim))
            if rows is not None:
                w = w * rows.reshape(rows.shape + (1,) * (len(shape) - 1))
            s, n = losses.as_sum_and_weight(t["fn"](pred, target, w, **t["kwargs"]))
            named[name] = (s, n)
            total = total + t["weight"] * s / jnp.maximum(n, 1e-12)
        n_rows = rows.sum() if rows is not None else jnp.float32(losses.batch_rows(batch))
        return (total * n_rows, n_rows), named

    return loss_fn

