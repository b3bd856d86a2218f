"""Recipe: complete a set from part of it (configs/recipes/set_completion.py).

Data: `jtrain.recipes.tokensets` sets (`n` train, seed 5; 1,024 eval, seed 6). Of each
set's members, k = round(0.3 n) (at least 1, at most n - 1) are hidden; the model sees
the rest and scores every vocabulary token as a missing member (multi-label: sigmoid
cross-entropy against the hidden members, tokens already visible not counted). Training
hides a fresh random subset per step inside the jitted step (keyed by the step); eval
hides a fixed subset per set (`hide`, drawn here with numpy). Logged besides the loss:
recall_at_10, the share of hidden members among the 10 best-scored tokens that are not
visible. The popularity baseline (the 10 most frequent training tokens not visible)
is printed at start-up.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jtrain import losses
from jtrain.recipes import tokensets
from jtrain.recipes.tokensets import PAD, VOCAB

HIDE_FRACTION, TOP = 0.3, 10


def _hide_numpy(tokens, seed):
    rng = np.random.default_rng(seed)
    present = tokens != PAD
    u = np.where(present, rng.uniform(size=tokens.shape), 2.0)
    ranks = np.argsort(np.argsort(u, axis=1), axis=1)
    n = present.sum(1, keepdims=True)
    k = np.clip(np.round(HIDE_FRACTION * n), 1, np.maximum(n - 1, 1))
    return (present & (ranks < k)).astype(np.float32)


def hide_in_graph(key, tokens):
    present = tokens != PAD
    u = jnp.where(present, jax.random.uniform(key, tokens.shape), 2.0)
    ranks = jnp.argsort(jnp.argsort(u, axis=1), axis=1)
    n = present.sum(1, keepdims=True)
    k = jnp.clip(jnp.round(HIDE_FRACTION * n), 1, jnp.maximum(n - 1, 1))
    return (present & (ranks < k)).astype(jnp.float32)


def _multi_hot(tokens, sel, xp):
    """[B, VOCAB] 0/1 of the tokens where sel is 1 (padding never)."""
    onehot = (tokens[..., None] == xp.arange(VOCAB)) & (tokens[..., None] != PAD)
    return (onehot * sel[..., None]).max(1).astype(xp.float32)


def _recall(scores, hidden_hot, visible_hot, xp):
    """Share of hidden members among the TOP best-scored tokens not visible."""
    scores = xp.where(visible_hot > 0, -xp.inf, scores)
    top = xp.argsort(-scores, axis=1)[:, :TOP]
    hits = xp.take_along_axis(hidden_hot, top, axis=1).sum(1)
    return hits.sum(), hidden_hot.sum()


def make_data(n=8192, max_len=12):
    """data.source: {"train", "eval"} with tokens, hide (eval only non-zero), id."""
    train = tokensets.generate(n, seed=5, max_len=max_len)
    evals = tokensets.generate(1024, seed=6, max_len=max_len)
    for split in (train, evals):
        del split["label"]
    train["hide"] = np.zeros(train["tokens"].shape, np.float32)
    evals["hide"] = _hide_numpy(evals["tokens"], 6)
    counts = _multi_hot(train["tokens"], train["tokens"] != PAD, np).sum(0)
    hidden_hot = _multi_hot(evals["tokens"], evals["hide"], np)
    visible_hot = _multi_hot(evals["tokens"], (evals["tokens"] != PAD) - evals["hide"], np)
    hits, total = _recall(np.broadcast_to(counts, hidden_hot.shape).astype(np.float64),
                          hidden_hot, visible_hot, np)
    print(f"recipe set_completion: {n} train / 1024 eval token sets, 30 % of each set "
          f"hidden (in the step when training); popularity baseline eval recall_at_10 "
          f"{hits / total:.4f}", flush=True)
    return {"train": train, "eval": evals}


class Completer(nn.Module):
    """{"tokens", "hide"} -> {"logits" [B, V], "hidden", "visible" [B, V] 0/1}."""
    width: int = 64
    layers: int = 2
    heads: int = 4

    @nn.compact
    def __call__(self, batch, train: bool = False):
        tokens = batch["tokens"]
        hide = hide_in_graph(self.make_rng("dropout"), tokens) if train else batch["hide"]
        visible_tokens = jnp.where(hide > 0, PAD, tokens)
        _, pooled = tokensets.SetEncoder(self.width, self.layers, self.heads,
                                         name="encoder")(visible_tokens)
        return {"logits": nn.Dense(VOCAB, name="head")(pooled),
                "hidden": _multi_hot(tokens, hide, jnp),
                "visible": _multi_hot(visible_tokens, visible_tokens != PAD, jnp)}


def make_model(width=64, layers=2, heads=4):
    """model.factory."""
    return Completer(width, layers, heads)


def loss(outputs, batch):
    """loss.fn: sigmoid cross-entropy summed over the tokens not visible, per set;
    recall_at_10 logged."""
    w = (1.0 - outputs["visible"]) * losses.weights_for(batch, outputs["visible"].shape)
    bce_sum, _ = losses.binary_cross_entropy(outputs["logits"], outputs["hidden"], weights=w)
    rows = losses.weights_for(batch, outputs["hidden"].shape[:1])
    recall = _recall(jax.lax.stop_gradient(outputs["logits"]),
                     outputs["hidden"] * rows[:, None], outputs["visible"], jnp)
    return (bce_sum, rows.sum()), {"recall_at_10": recall}
