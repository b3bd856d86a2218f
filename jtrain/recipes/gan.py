"""A GAN on a 2-D mixture of 8 Gaussians on a ring, as a step of your own
(configs/recipes/gan.py; jtrain.step.Step): two NNX MLPs, two optax optimizers, one
discriminator and one generator update per step (the non-saturating loss), both losses
logged (train/d_loss, train/g_loss; train/loss is their sum).

Quality as a contract: `evaluate` returns generated points for a fixed set of latents,
scored against the data by the energy distance (`energy_distance`): the trained generator
must come within a stated factor of the distance between two samples of the data itself,
and well below the untrained generator's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jtrain.step import Context, Step, optimizer_update

LATENT = 8


class MLP(nnx.Module):
    def __init__(self, din, dout, hidden, rngs):
        self.l1 = nnx.Linear(din, hidden, rngs=rngs)
        self.l2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.l3 = nnx.Linear(hidden, dout, rngs=rngs)

    def __call__(self, x):
        return self.l3(nnx.relu(self.l2(nnx.relu(self.l1(x)))))


def ring(n: int, seed: int) -> np.ndarray:
    """n points from 8 Gaussians (std 0.05) on the unit circle."""
    rng = np.random.default_rng(seed)
    angle = rng.integers(0, 8, n) * (2 * np.pi / 8)
    centers = np.stack([np.cos(angle), np.sin(angle)], 1)
    return (centers + rng.normal(0, 0.05, (n, 2))).astype(np.float32)


def make_data(n: int = 8192, n_eval: int = 512, seed: int = 0):
    """data.source: {"train", "eval"}; each example a point `x` and a latent `z` (eval:
    fixed latents, so every evaluation scores the same draws)."""
    rng = np.random.default_rng(seed + 7)
    return {"train": {"x": ring(n, seed), "z": rng.normal(size=(n, LATENT)).astype(np.float32)},
            "eval": {"x": ring(n_eval, seed + 1),
                     "z": rng.normal(size=(n_eval, LATENT)).astype(np.float32)}}


def energy_distance(a, b) -> float:
    """The energy distance between two point sets (0 when they are equally distributed):
    2 E|a - b| - E|a - a'| - E|b - b'|."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)

    def mean_dist(u, v):
        return np.sqrt(((u[:, None] - v[None]) ** 2).sum(-1)).mean()

    return float(2 * mean_dist(a, b) - mean_dist(a, a) - mean_dist(b, b))


def eval_loss(outputs, batch):
    """loss.fn (loss.eval_scope = "batch"): the energy distance between the generated
    points and the batch's real ones; jtrain weights each batch by its rows."""
    def mean_dist(u, v):
        return jnp.sqrt(((u[:, None] - v[None]) ** 2).sum(-1) + 1e-12).mean()

    x = batch["x"]
    return 2 * mean_dist(outputs, x) - mean_dist(outputs, outputs) - mean_dist(x, x)


def make(hidden: int = 64, lr: float = 1e-3) -> Step:
    """step.factory: the GAN's init / update / evaluate."""
    g_def = nnx.graphdef(nnx.eval_shape(lambda: MLP(LATENT, 2, hidden, nnx.Rngs(0))))
    d_def = nnx.graphdef(nnx.eval_shape(lambda: MLP(2, 1, hidden, nnx.Rngs(0))))
    g_tx = optax.adam(lr, b1=0.5)
    d_tx = optax.adam(lr, b1=0.5)

    def gen(params, z):
        return nnx.merge(g_def, params)(z)

    def disc(params, x):
        return nnx.merge(d_def, params)(x)[:, 0]

    def init(rng, example):
        del example
        kg, kd = jax.random.split(rng)
        g = nnx.state(MLP(LATENT, 2, hidden, nnx.Rngs(kg)), nnx.Param)
        d = nnx.state(MLP(2, 1, hidden, nnx.Rngs(kd)), nnx.Param)
        g, d = nnx.to_pure_dict(g), nnx.to_pure_dict(d)
        return {"g": g, "d": d, "g_opt": g_tx.init(g), "d_opt": d_tx.init(d)}

    def update(state, batch, rng, context: Context):
        del rng
        x, z = batch["x"], batch["z"]

        def d_loss(d):
            real, fake = disc(d, x), disc(d, gen(state["g"], z))
            return (optax.sigmoid_binary_cross_entropy(real, jnp.ones_like(real)).mean()
                    + optax.sigmoid_binary_cross_entropy(fake, jnp.zeros_like(fake)).mean())

        dl, dg = jax.value_and_grad(d_loss)(state["d"])
        d, d_opt = optimizer_update(d_tx, dg, state["d_opt"], state["d"], context.lr_factor)

        def g_loss(g):
            fake = disc(d, gen(g, z))
            return optax.sigmoid_binary_cross_entropy(fake, jnp.ones_like(fake)).mean()

        gl, gg = jax.value_and_grad(g_loss)(state["g"])
        g, g_opt = optimizer_update(g_tx, gg, state["g_opt"], state["g"], context.lr_factor)
        return ({"g": g, "d": d, "g_opt": g_opt, "d_opt": d_opt},
                {"loss": dl + gl, "d_loss": dl, "g_loss": gl})

    def evaluate(state, batch):
        """The generated points for the batch's latents (scored by `eval_loss`)."""
        return gen(state["g"], batch["z"])

    return Step(init=init, update=update, evaluate=evaluate, name="gan")
