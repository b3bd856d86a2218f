"""Distillation of the reference transformer into a smaller student, as a step of your own
(configs/recipes/distill.py; jtrain.step.Step).

The state holds the teacher's parameters (frozen: no gradient, no optimizer state; filled
by `init.path` = a run of configs/base.py with `init.into =
"teacher"`), the student's and the student's AdamW state. The loss is the usual mix
(Hinton et al. 2015): `alpha` x the cross-entropy against the next byte plus
`(1 - alpha) x T^2` x the KL divergence from the teacher's softened distribution to the
student's, both token-weighted as the built-in loss is. `evaluate` returns the student's
logits, so eval/loss is the student's cross-entropy, comparable with the teacher's run
and with the student trained alone (the built-in update on the student's config).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jtrain import losses
from jtrain.step import Context, Step, optimizer_update

TEACHER = {"d_model": 64, "num_layers": 2, "num_heads": 4, "d_ff": 256, "max_len": 64}
STUDENT = {"d_model": 32, "num_layers": 1, "num_heads": 2, "d_ff": 128, "max_len": 64}


def _model(sizes: dict):
    from jtrain.models import make_model

    return make_model({"name": "transformer", **sizes}, dtype=jnp.float32,
                      param_dtype=jnp.float32)


def make(teacher: dict | None = None, student: dict | None = None, alpha: float = 0.5,
         temperature: float = 2.0, lr: float = 3e-3) -> Step:
    """step.factory: the teacher's and the student's sizes (the reference transformer's
    model.* keys), the loss mix and the student's learning rate."""
    t_model = _model({**TEACHER, **(teacher or {})})
    s_model = _model({**STUDENT, **(student or {})})
    tx = optax.adamw(lr, weight_decay=0.1)

    def init(rng, example):
        tokens = jnp.asarray(example["inputs"])[None]
        kt, ks = jax.random.split(rng)
        teacher_params = t_model.init({"params": kt, "dropout": kt}, tokens)["params"]
        student_params = s_model.init({"params": ks, "dropout": ks}, tokens)["params"]
        from flax import linen as nn

        return {"teacher": teacher_params, "student": student_params,
                "opt": tx.init(nn.unbox(student_params))}

    def update(state, batch, rng, context: Context):
        teacher_logits = jax.lax.stop_gradient(
            t_model.apply({"params": state["teacher"]}, batch["inputs"]))
        t = temperature

        def loss(params):
            logits = s_model.apply({"params": params}, batch["inputs"], train=True,
                                   rngs={"dropout": rng})
            ce_sum, weight = losses.default_loss(logits, batch)
            w = losses.weights_for(batch, logits.shape[:-1])
            p_teacher = jax.nn.softmax(teacher_logits / t)
            kl = (p_teacher * (jax.nn.log_softmax(teacher_logits / t)
                               - jax.nn.log_softmax(logits / t))).sum(-1)
            ce = ce_sum / jnp.maximum(weight, 1e-12)
            kd = (kl * w).sum() / jnp.maximum(weight, 1e-12)
            return alpha * ce + (1 - alpha) * t * t * kd, (ce, kd)

        (value, (ce, kd)), grads = jax.value_and_grad(loss, has_aux=True)(state["student"])
        student, opt = optimizer_update(tx, grads, state["opt"], state["student"],
                                        context.lr_factor)
        return ({"teacher": state["teacher"], "student": student, "opt": opt},
                {"loss": value, "ce": ce, "kd": kd, "grad_norm": optax.tree.norm(grads)})

    def evaluate(state, batch):
        return s_model.apply({"params": state["student"]}, batch["inputs"])

    return Step(init=init, update=update, evaluate=evaluate, name="distill")
