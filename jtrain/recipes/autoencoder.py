"""Recipe: a multi-modal autoencoder with a weighted multi-loss
(configs/recipes/multiloss_autoencoder.py).

The data (`make_data`), from `seed`: per example a shared latent z ~ N(0, I_4); two
modalities made from it, "rna" (40 features) = tanh(z A) B + N(0, 0.3^2) and "protein"
(12 features) = softplus(z C) + N(0, 0.2^2), with A, B, C fixed Gaussian matrices.
`n` train examples, 1,024 eval (a different seed). The model (Flax NNX) encodes both
modalities into one 4-d latent and decodes each; the loss is a weighted sum of the two
MSE reconstructions and a Pearson-correlation term tying each latent dimension to the
matching dimension of z (loss.terms in the config), each term logged.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

LATENT, RNA, PROTEIN = 4, 40, 12


def _make(n, seed, maps):
    rng = np.random.default_rng(seed)
    a, b, c = maps
    z = rng.normal(size=(n, LATENT))
    rna = np.tanh(z @ a) @ b + rng.normal(0, 0.3, (n, RNA))
    protein = np.logaddexp(0, z @ c) + rng.normal(0, 0.2, (n, PROTEIN))
    return {"rna": rna.astype(np.float32), "protein": protein.astype(np.float32),
            "z": z.astype(np.float32)}


def make_data(n=4096, seed=0):
    """data.source: {"train", "eval"} dicts with rna, protein and the latent target z."""
    rng = np.random.default_rng(seed)
    maps = (rng.normal(size=(LATENT, 16)), rng.normal(size=(16, RNA)) / 4,
            rng.normal(size=(LATENT, PROTEIN)))
    train, evals = _make(n, seed + 1, maps), _make(1024, seed + 2, maps)
    base = {k: float(((evals[k] - train[k].mean(0)) ** 2).mean()) for k in ("rna", "protein")}
    print(f"recipe multiloss_autoencoder: {n} train / 1024 eval examples, rna {RNA} + "
          f"protein {PROTEIN} features from a shared {LATENT}-d latent; weighted MSE "
          "reconstructions + a Pearson term on the latent; predicting the training mean "
          f"gives eval recon_rna {base['rna']:.4f}, recon_protein {base['protein']:.4f}",
          flush=True)
    return {"train": train, "eval": evals}


class AutoEncoder(nnx.Module):
    """{"rna", "protein"} -> {"rna", "protein" reconstructions, "latent" [B, 4]}."""

    def __init__(self, rngs: nnx.Rngs, hidden: int = 64):
        self.enc_rna = nnx.Linear(RNA, hidden, rngs=rngs)
        self.enc_protein = nnx.Linear(PROTEIN, hidden, rngs=rngs)
        self.to_latent = nnx.Linear(2 * hidden, LATENT, rngs=rngs)
        self.dec_rna = nnx.Sequential(nnx.Linear(LATENT, hidden, rngs=rngs), jax.nn.gelu,
                                      nnx.Linear(hidden, RNA, rngs=rngs))
        self.dec_protein = nnx.Sequential(nnx.Linear(LATENT, hidden, rngs=rngs),
                                          jax.nn.gelu, nnx.Linear(hidden, PROTEIN, rngs=rngs))

    def __call__(self, x):
        h = jax.numpy.concatenate([jax.nn.gelu(self.enc_rna(x["rna"])),
                                   jax.nn.gelu(self.enc_protein(x["protein"]))], -1)
        latent = self.to_latent(h)                                   # [B, 4]
        return {"rna": self.dec_rna(latent), "protein": self.dec_protein(latent),
                "latent": latent}


def make_model(hidden=64):
    """model.factory: a function rngs -> the NNX module."""
    return lambda rngs: AutoEncoder(rngs, hidden)


def latent(outputs, batch):
    """eval.predict_fn: the latent vs the shared target z (eval/pearson, pooled)."""
    return outputs["latent"], batch["z"]
