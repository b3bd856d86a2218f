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
experts run as einsums over [E, C, D] with their weights split over mesh axes `fsdp`
x `expert` (the logical axis `expert`, jtrain.mesh.LOGICAL_RULES). With mesh.expert
> 1 (`expert_parallel`) each batch shard routes its own N / shards tokens with its own
capacity and exchanges the dispatched slots with the experts' devices by
jax.lax.all_to_all inside shard_map: the compiled step has two all-to-alls per MoE
layer forward (and two in the backward pass).

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
    (dispatch times the renormalised gate), (f_e, P_e) for `balance_loss`, dropped
    assignments)."""
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
    dropped = jnp.sum(~kept).astype(jnp.float32)
    return dispatch, combine, (routed, jnp.mean(probs, axis=0)), dropped


def balance_loss(balance) -> jax.Array:
    """The Switch load-balancing loss E * sum_e f_e * P_e of route's (f_e, P_e)."""
    routed, mean_probs = balance
    return routed.shape[0] * jnp.sum(routed * mean_probs)


def run_experts(tokens, logits, weights, k: int, capacity_factor: float, kind: str,
                dtype, constrain=lambda xs: xs, exchange: str | None = None):
    """The MoE MLP over tokens [N, D] with router logits [N, E]: route, dispatch into
    [E, C, D], the experts' MLPs (weights (w_in [E', D, F], w_gate or None,
    w_out [E', F, D])), combine -> (y [N, D], route's balance, dropped). `exchange`: the
    mesh axis (inside shard_map) over which the E' = E / n local experts' devices swap
    their slots by all-to-all, there and back; None: all E experts are here."""
    w_in, w_gate, w_out = weights
    dispatch, combine, balance, dropped = route(logits, k, capacity_factor)
    xs = constrain(jnp.einsum("nec,nd->ecd", dispatch.astype(dtype), tokens.astype(dtype)))
    if exchange:  # [E, C, D] -> [E/n, n*C, D]: each device's slots of its own experts
        xs = jax.lax.all_to_all(xs, exchange, 0, 1, tiled=True)
    h = jnp.einsum("ecd,edf->ecf", xs, w_in.astype(dtype))
    if kind == "swiglu":
        h = jax.nn.silu(jnp.einsum("ecd,edf->ecf", xs, w_gate.astype(dtype))) * h
    else:
        h = jax.nn.gelu(h)  # the tanh approximation (flax's nn.gelu)
    ys = jnp.einsum("ecf,efd->ecd", h, w_out.astype(dtype))  # [E', C', D]
    if exchange:  # back: [E/n, n*C, D] -> [E, C, D]
        ys = jax.lax.all_to_all(ys, exchange, 1, 0, tiled=True)
    return jnp.einsum("nec,ecd->nd", combine.astype(dtype), ys), balance, dropped


def expert_parallel(tokens, logits, weights, k: int, capacity_factor: float, kind: str,
                    dtype, mesh):
    """run_experts with the experts split over mesh axis `expert` (shard_map): each
    batch shard (data x fsdp x expert) routes its own tokens with its own capacity,
    sends each expert's slots to the device holding it (all-to-all over `expert`) and
    takes the outputs back. f_e and P_e are averaged over the shards (the balance loss
    of the whole batch); dropped assignments summed."""
    from jax.sharding import PartitionSpec as P

    from jtrain.mesh import BATCH_AXES

    def local(tokens, logits, weights):
        y, (routed, probs), dropped = run_experts(tokens, logits, weights, k,
                                                  capacity_factor, kind, dtype,
                                                  exchange="expert")
        return (y, (jax.lax.pmean(routed, BATCH_AXES), jax.lax.pmean(probs, BATCH_AXES)),
                jax.lax.psum(dropped, BATCH_AXES))

    rows, experts = P(BATCH_AXES, None), P("expert", None, None)
    return jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, experts),
                         out_specs=(rows, (P(), P()), P()))(tokens, logits, weights)


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
