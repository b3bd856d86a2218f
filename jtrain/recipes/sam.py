"""Sharpness-aware minimisation (SAM, Foret et al. 2021) as a step of your own
(configs/recipes/sam.py; jtrain.step.Step), on scikit-learn's breast-cancer table (the
split of jtrain/recipes/classify.py) with jtrain's own MLP (`jtrain.models.make_model`)
and AdamW (`jtrain.make_optimizer`), the model and optimizer the built-in update would
use for the same sections (`model_section`, `optim_section`).

One update is two gradient evaluations: the gradient g at w, the ascent step
e = rho * g / ||g||, the gradient at w + e, and the optax update applied at w with that
second gradient. Logged: train/loss (at w), train/sharpness (the loss at w + e minus the
loss at w: about rho * ||g|| while the loss is locally linear, never negative by much)
and train/grad_norm (||g||). The cost: about twice the built-in update's step time
(`python -m jtrain.bench sam`, docs/benchmarks.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

from jtrain import losses
from jtrain.models import make_model
from jtrain.optim import make_optimizer
from jtrain.step import Context, Step, optimizer_update


def model_section(hidden=(32, 32), num_outputs: int = 2) -> dict:
    """The `model` section of the MLP, as the built-in update's config would name it."""
    return {"name": "mlp", "hidden": list(hidden), "num_outputs": num_outputs,
            "dropout": 0.0, "activation": "gelu"}


def optim_section(lr: float = 1e-3, weight_decay: float = 1e-3) -> dict:
    """The `optim` section of AdamW at a constant learning rate."""
    return {"name": "adamw", "lr": lr, "weight_decay": weight_decay,
            "schedule": "constant", "warmup_steps": 0}


def make_data(split_seed=0, eval_fraction=0.2):
    """data.source: the breast-cancer split of the classify recipe."""
    from jtrain.recipes import classify

    data = classify.split(split_seed, eval_fraction)
    (x, _), (x_eval, _) = data["train"], data["eval"]
    print(f"recipe sam: scikit-learn breast cancer, {len(x)} train / {len(x_eval)} eval "
          f"tumours x {x.shape[1]} features (standardised)", flush=True)
    return data


def make(hidden=(32, 32), num_outputs: int = 2, lr: float = 1e-3,
         weight_decay: float = 1e-3, rho: float = 0.05) -> Step:
    """step.factory: SAM's init / update / evaluate around the MLP and AdamW."""
    model = make_model(model_section(hidden, num_outputs), dtype=jnp.float32,
                       param_dtype=jnp.float32)
    tx, _ = make_optimizer(optim_section(lr, weight_decay), total_steps=1)

    def loss_at(params, batch):
        total, weight = losses.default_loss(model.apply({"params": params}, batch["inputs"]),
                                            batch)
        return total / weight

    def init(rng, example):
        boxed = model.init(rng, example["inputs"][None])["params"]  # logical annotations
        return {"params": boxed, "opt": tx.init(nn.unbox(boxed))}

    def update(state, batch, rng, context: Context):
        del rng
        params = state["params"]
        loss, g = jax.value_and_grad(loss_at)(params, batch)
        norm = optax.global_norm(g)
        scale = rho / (norm + 1e-12)
        ascent = jax.tree.map(lambda w, d: w + scale * d, params, g)
        perturbed, g_sam = jax.value_and_grad(loss_at)(ascent, batch)
        params, opt = optimizer_update(tx, g_sam, state["opt"], params, context.lr_factor)
        return ({"params": params, "opt": opt},
                {"loss": loss, "sharpness": perturbed - loss, "grad_norm": norm})

    def evaluate(state, batch):
        """The logits (scored by the default loss and eval.metrics against targets)."""
        return model.apply({"params": state["params"]}, batch["inputs"])

    return Step(init=init, update=update, evaluate=evaluate, name="sam")
