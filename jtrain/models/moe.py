"""Mixture of experts for the built-in transformer (`model.moe.*`): top-k routing with
a capacity per expert, and the training step's view of what the layers report.

Routing (`route`), over the N tokens of a forward pass: a float32 softmax router gives
each token its probabilities over E experts; its k largest (`jax.lax.top_k`: equal
values in index order, so routing is deterministic and a resumed run routes the same)
are its experts, with gates renormalised to sum to 1. Each expert takes at most
C = ceil(capacity_factor * N * k / E) assignments, filled in priority order: every
token's first choice, in token order, then every token's second choice, and so on.
An assignment past its expert's capacity is dropped: it adds nothing to the token's
output (with every choice dropped the MLP's output is zero and the residual passes).

Dispatch and combine are one-hot tensors [N, E, C] (GShard / Switch style), so the
experts run as einsums over [E, C, D] with their weights split over mesh axis `fsdp`
(the logical axis `expert`, jtrain.mesh.LOGICAL_RULES).

Each MoE layer sows into the "intermediates" collection: "moe_aux", the Switch
load-balancing loss E * sum_e f_e * P_e (f_e the fraction of the N*k assignments routed
to e before capacity, P_e the mean router probability of e; 1 when balanced), and
"moe_dropped" / "moe_assigned", the dropped and the total assignments. `with_moe_terms`
adds `model.moe.aux_weight` times the layers' mean aux loss to the training loss and
logs train/moe_aux_loss and train/moe_dropped_fraction.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import traverse_util

from jtrain import losses

SOWN = ("moe_aux", "moe_dropped", "moe_assigned")


def capacity(tokens: int, experts: int, k: int, capacity_factor: float) -> int:
    """Assignments one expert takes: ceil(capacity_factor * tokens * k / experts), >= 1."""
    return max(1, math.ceil(capacity_factor * tokens * k / experts))


def route(logits: jax.Array, k: int, capacity_factor: float):
    """Router logits [N, E] -> (dispatch [N, E, C] float32 one-hot, combine [N, E, C]
    (dispatch times the renormalised gate), aux loss, dropped assignments)."""
    n, e = logits.shape
    c = capacity(n, e, k, capacity_factor)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # [N, E]
    top, idx = jax.lax.top_k(probs, k)  # [N, k]: ties in index order
    gates = top / jnp.sum(top, axis=-1, keepdims=True)  # [N, k]
    chosen = jax.nn.one_hot(idx, e, dtype=jnp.int32)  # [N, k, E]
    by_choice = jnp.swapaxes(chosen, 0, 1).reshape(k * n, e)  # choice-major priority
    slot = jnp.sum((jnp.cumsum(by_choice, axis=0) - 1) * by_choice, axis=-1)  # [k*N]
    slot = jnp.swapaxes(slot.reshape(k, n), 0, 1)  # [N, k]: place in its expert's queue
    kept = slot < c  # [N, k]
    place = jax.nn.one_hot(jnp.where(kept, slot, c), c, dtype=jnp.float32)  # [N, k, C]
    dispatch = jnp.einsum("nke,nkc->nec", chosen.astype(jnp.float32), place)
    combine = jnp.einsum("nke,nkc,nk->nec", chosen.astype(jnp.float32), place, gates)
    routed = jnp.sum(chosen, axis=(0, 1)).astype(jnp.float32) / (n * k)  # f_e
    aux = e * jnp.sum(routed * jnp.mean(probs, axis=0))
    dropped = jnp.sum(~kept).astype(jnp.float32)
    return dispatch, combine, aux, dropped


def sown_totals(intermediates) -> dict[str, jax.Array]:
    """The layers' sown values summed per name (SOWN): {} for a dense model."""
    totals: dict[str, list] = {}
    for path, values in traverse_util.flatten_dict(intermediates).items():
        if path[-1] in SOWN:
            totals.setdefault(path[-1], []).extend(values)
    return {name: sum(v) for name, v in totals.items()} | (
        {"layers": jnp.float32(len(totals["moe_aux"]))} if totals else {})


def with_moe_terms(module, loss_fn: Callable, predict_fn: Callable | None,
                   aux_weight: float):
    """(apply, loss_fn, predict_fn) for the training step of the built-in `module` with
    MoE layers: apply returns {"logits", "moe"} (the layers' sown totals); the loss is
    `loss_fn`'s plus aux_weight times the layers' mean aux loss, with the terms
    moe_aux_loss and moe_dropped_fraction; the metrics read the logits."""
    def apply(params, inputs, rng=None, train=False, mutable=False):
        del mutable  # the transformer has no state
        rngs = {"dropout": rng} if (train and rng is not None) else {}
        logits, sown = module.apply({"params": params}, inputs, rngs=rngs, train=train,
                                    mutable=["intermediates"])
        return {"logits": logits, "moe": sown_totals(sown.get("intermediates", {}))}

    def loss(outputs, batch):
        (loss_sum, weight), terms = losses.split_loss(loss_fn(outputs["logits"], batch))
        moe = outputs["moe"]
        aux = moe["moe_aux"] / moe["layers"]
        terms = {**terms, "moe_aux_loss": (aux * weight, weight),
                 "moe_dropped_fraction": (moe["moe_dropped"], moe["moe_assigned"])}
        return (loss_sum + aux_weight * aux * weight, weight), terms

    def predict(outputs, batch):
        if predict_fn is None:
            return outputs["logits"], batch["targets"], losses.weights_for(
                batch, batch["targets"].shape)
        return predict_fn(outputs["logits"], batch)

    return apply, loss, predict
