"""Recipes: masked pretraining of a set encoder, then a classifier fine-tuned from it
(configs/recipes/masked_pretrain.py, configs/recipes/finetune.py).

Data: `jtrain.recipes.tokensets` (sets of tokens drawn from gene programs, padded).
Pretraining (`make_pretrain_data`: `n` unlabelled sets, seed 1; eval 512 sets, seed 2)
picks 15 % of each set's members (at least one) inside the jitted step, keyed by the
step: 80 % of those become [MASK], 10 % a random token, 10 % stay; the loss is cross-
entropy on the picked members only. Eval picks with a fixed key folded with each set's
`id`, so every eval sees the same picks.

Fine-tuning (`make_finetune_data`): `labelled` labelled sets (seed 3) and 1,024 eval
sets (seed 4); `Classifier` is the same `encoder` plus a new `cls_head`, started from
the pretrained run's best checkpoint (init.path, init.exclude the head).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jtrain import losses
from jtrain.recipes import tokensets
from jtrain.recipes.tokensets import MASK, PAD, VOCAB, FIRST_TOKEN

MASK_RATE = 0.15


def make_pretrain_data(n=8192, max_len=12):
    """data.source of the pretraining: {"train", "eval"} dicts of token sets."""
    train = tokensets.generate(n, seed=1, max_len=max_len)
    evals = tokensets.generate(512, seed=2, max_len=max_len)
    for split in (train, evals):
        del split["label"]  # pretraining uses no labels
    print(f"recipe masked_pretrain: {n} unlabelled token sets (vocab {VOCAB}, up to "
          f"{max_len} members, padded); 15 % of members picked per step in the step, "
          "80/10/10 mask/random/keep", flush=True)
    return {"train": train, "eval": evals}


def pick_and_corrupt(key, tokens):
    """(corrupted tokens, picked [B, L] 0/1): 15 % of members (>= 1 per set), 80/10/10."""
    k_pick, k_what, k_rand = jax.random.split(key, 3)
    present = tokens != PAD
    u = jnp.where(present, jax.random.uniform(k_pick, tokens.shape), 2.0)
    n = present.sum(1, keepdims=True)
    k = jnp.maximum(1, jnp.round(MASK_RATE * n))
    ranks = jnp.argsort(jnp.argsort(u, axis=1), axis=1)
    picked = present & (ranks < k)
    what = jax.random.uniform(k_what, tokens.shape)
    random_tok = jax.random.randint(k_rand, tokens.shape, FIRST_TOKEN, VOCAB)
    corrupted = jnp.where(picked & (what < 0.8), MASK,
                          jnp.where(picked & (what < 0.9), random_tok, tokens))
    return corrupted, picked.astype(jnp.float32)


class MaskedModel(nn.Module):
    """{"tokens", "id"} -> {"logits" [B, L, V], "picked" [B, L]}."""
    width: int = 64
    layers: int = 2
    heads: int = 4

    @nn.compact
    def __call__(self, batch, train: bool = False):
        tokens = batch["tokens"]
        if train:
            corrupted, picked = pick_and_corrupt(self.make_rng("dropout"), tokens)
        else:  # the same picks at every eval: a fixed key per set id
            keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(1234), i))(batch["id"])
            corrupted, picked = jax.vmap(
                lambda k, t: jax.tree.map(lambda x: x[0], pick_and_corrupt(k, t[None])))(
                keys, tokens)
        members, _ = tokensets.SetEncoder(self.width, self.layers, self.heads,
                                          name="encoder")(corrupted)
        return {"logits": nn.Dense(VOCAB, name="mlm_head")(members), "picked": picked}


def make_pretrain_model(width=64, layers=2, heads=4):
    """model.factory of the pretraining."""
    return MaskedModel(width, layers, heads)


def mlm_loss(outputs, batch):
    """loss.fn: cross-entropy on the picked members (rows of the eval padding excluded)."""
    w = outputs["picked"] * losses.weights_for(batch, outputs["picked"].shape)
    return losses.masked_cross_entropy(outputs["logits"], batch["tokens"], weights=w)


def mlm_predict(outputs, batch):
    """eval.predict_fn: the picked members' logits vs the original tokens."""
    return outputs["logits"], batch["tokens"], outputs["picked"]


def make_finetune_data(labelled=64, max_len=12):
    """data.source of the fine-tune: a few labelled sets, a larger labelled eval set."""
    train = tokensets.generate(labelled, seed=3, max_len=max_len)
    evals = tokensets.generate(1024, seed=4, max_len=max_len)
    print(f"recipe finetune: {labelled} labelled token sets ({tokensets.PROGRAMS} "
          "classes), 1024 eval sets", flush=True)
    return {"train": {"inputs": train["tokens"], "targets": train["label"]},
            "eval": {"inputs": evals["tokens"], "targets": evals["label"]}}


class Classifier(nn.Module):
    """tokens [B, L] -> logits [B, classes]: the pretrained `encoder` + a new `cls_head`."""
    width: int = 64
    layers: int = 2
    heads: int = 4
    classes: int = tokensets.PROGRAMS

    @nn.compact
    def __call__(self, tokens):
        _, pooled = tokensets.SetEncoder(self.width, self.layers, self.heads,
                                         name="encoder")(tokens)
        return nn.Dense(self.classes, name="cls_head")(pooled)


def make_classifier(width=64, layers=2, heads=4):
    """model.factory of the fine-tune."""
    return Classifier(width, layers, heads)
