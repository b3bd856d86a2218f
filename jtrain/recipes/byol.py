"""BYOL (Grill et al. 2020) as a step of your own (configs/recipes/byol.py;
jtrain.step.Step): a self-supervised representation with an EMA target network kept and
updated inside the step, on a small synthetic set (`make_data`).

The data: points from `CLUSTERS` Gaussian clusters on a circle in 2-D, lifted to `DIM`-D
by a fixed random linear map, with isotropic noise added in all `DIM` dimensions; the
label is the cluster (never seen by training: only the probe reads it).

The step: an online encoder + projector + predictor (MLPs) trained by AdamW, a target
encoder + projector that is an exponential moving average of the online ones
(target <- tau * target + (1 - tau) * online, after each update), two augmented views of
each example (Gaussian noise and a random feature mask, drawn from the step's rng), the
normalised-MSE loss 2 - 2 cos(prediction of one view, target projection of the other)
symmetrised over the views, the target under stop-gradient. The whole of it (online,
target, optimizer state) is the state: checkpointed and resumed bitwise.

Quality as a contract (`probe_accuracy`): a least-squares linear probe on the encoder's
representation (fitted on the train split, scored on the eval split) after training beats
the same probe on the untrained encoder; `evaluate` returns the representation and the
eval loss (`eval_loss`, batch-level) is the share of its variance within clusters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jtrain.step import Context, Step, optimizer_update

CLUSTERS = 8
DIM = 16


def make_data(n: int = 4096, n_eval: int = 1024, noise: float = 0.4, seed: int = 0):
    """data.source: {"train", "eval"}, each {"inputs": float32 [n, DIM], "labels": int32
    [n]}: cluster centres on the unit circle (std 0.15 around each), a fixed random
    2 -> DIM linear lift, then N(0, noise^2) in every dimension."""
    rng = np.random.default_rng(seed)
    lift = rng.normal(size=(2, DIM)) / np.sqrt(2)

    def draw(m):
        labels = rng.integers(0, CLUSTERS, m)
        angle = labels * (2 * np.pi / CLUSTERS)
        points = np.stack([np.cos(angle), np.sin(angle)], 1) + rng.normal(0, 0.15, (m, 2))
        x = points @ lift + rng.normal(0, noise, (m, DIM))
        return {"inputs": x.astype(np.float32), "labels": labels.astype(np.int32)}

    return {"train": draw(n), "eval": draw(n_eval)}


def _mlp_init(rng, sizes):
    keys = jax.random.split(rng, len(sizes) - 1)
    return [{"w": jax.random.normal(k, (a, b)) * np.sqrt(2.0 / a), "b": jnp.zeros(b)}
            for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)]


def _mlp(layers, x):
    for layer in layers[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ layers[-1]["w"] + layers[-1]["b"]


def encode(encoder, x):
    """The representation: the encoder MLP's output."""
    return _mlp(encoder, x)


def _normalised_mse(p, z):
    p = p / (jnp.linalg.norm(p, axis=-1, keepdims=True) + 1e-6)
    z = z / (jnp.linalg.norm(z, axis=-1, keepdims=True) + 1e-6)
    return 2 - 2 * (p * z).sum(-1)


def augment(rng, x, noise: float, keep: float):
    """One view: a random feature mask (each kept with probability `keep`) and Gaussian
    noise of std `noise`."""
    k_mask, k_noise = jax.random.split(rng)
    mask = jax.random.bernoulli(k_mask, keep, x.shape)
    return jnp.where(mask, x, 0.0) + noise * jax.random.normal(k_noise, x.shape)


def make(width: int = 64, rep: int = 8, proj: int = 16, lr: float = 3e-3,
         weight_decay: float = 1e-4, tau: float = 0.99, noise: float = 0.5,
         keep: float = 0.8) -> Step:
    """step.factory: BYOL's init / update / evaluate."""
    tx = optax.adamw(lr, weight_decay=weight_decay)

    def init(rng, example):
        din = example["inputs"].shape[-1]
        k_enc, k_proj, k_pred = jax.random.split(rng, 3)
        online = {"encoder": _mlp_init(k_enc, [din, width, rep]),
                  "projector": _mlp_init(k_proj, [rep, width, proj])}
        trained = {"online": online, "predictor": _mlp_init(k_pred, [proj, width, proj])}
        # The target starts as a copy of the online networks (BYOL's initialisation).
        target = jax.tree.map(jnp.copy, online)
        return {**trained, "target": target, "opt": tx.init(trained)}

    def update(state, batch, rng, context: Context):
        x = batch["inputs"]
        k1, k2 = jax.random.split(rng)
        v1, v2 = augment(k1, x, noise, keep), augment(k2, x, noise, keep)

        def target_proj(v):
            t = state["target"]
            return jax.lax.stop_gradient(_mlp(t["projector"], _mlp(t["encoder"], v)))

        z1, z2 = target_proj(v1), target_proj(v2)

        def loss_fn(trained):
            net = trained["online"]

            def predict(v):
                return _mlp(trained["predictor"], _mlp(net["projector"], _mlp(net["encoder"], v)))

            return (_normalised_mse(predict(v1), z2) + _normalised_mse(predict(v2), z1)).mean()

        trained = {"online": state["online"], "predictor": state["predictor"]}
        loss, grads = jax.value_and_grad(loss_fn)(trained)
        trained, opt = optimizer_update(tx, grads, state["opt"], trained, context.lr_factor)
        target = jax.tree.map(lambda t, o: tau * t + (1 - tau) * o, state["target"],
                              trained["online"])
        drift = optax.global_norm(jax.tree.map(jnp.subtract, target, trained["online"]))
        return ({**trained, "target": target, "opt": opt},
                {"loss": loss, "target_drift": drift})

    def evaluate(state, batch):
        """The online encoder's representation of the (unaugmented) inputs."""
        return encode(state["online"]["encoder"], batch["inputs"])

    return Step(init=init, update=update, evaluate=evaluate, name="byol")


def eval_loss(outputs, batch):
    """loss.fn (loss.eval_scope = "batch"): the share of the representation's variance
    that lies within clusters (0: each cluster one point; about 1: no cluster structure)."""
    labels = jax.nn.one_hot(batch["labels"], CLUSTERS)  # [B, K]
    counts = labels.sum(0)  # [K]
    means = (labels.T @ outputs) / jnp.maximum(counts, 1)[:, None]  # [K, R]
    within = ((outputs - labels @ means) ** 2).sum()
    total = ((outputs - outputs.mean(0)) ** 2).sum()
    return within / (total + 1e-12)


def probe_accuracy(encoder, train, held_out, labelled: int = 0, ridge: float = 1e-3) -> float:
    """A least-squares linear probe (one-hot targets, a bias, ridge `ridge`) on
    `encode(encoder, x)`: fitted on `train` (its first `labelled` rows; 0 = all), its
    accuracy on `held_out` ({"inputs", "labels"} numpy arrays)."""
    if labelled:
        train = {k: v[:labelled] for k, v in train.items()}
    def features(x):
        f = np.asarray(encode(encoder, jnp.asarray(x)), np.float64)
        return np.concatenate([f, np.ones((len(f), 1))], 1)

    f = features(train["inputs"])
    y = np.eye(CLUSTERS)[train["labels"]]
    w = np.linalg.solve(f.T @ f + ridge * len(f) * np.eye(f.shape[1]), f.T @ y)
    return float((features(held_out["inputs"]) @ w).argmax(1).__eq__(held_out["labels"]).mean())
