"""Direct preference optimisation (Rafailov et al. 2023) of the built-in transformer, as a
step of your own (configs/recipes/dpo.py; jtrain.step.Step).

The state holds the policy's parameters (trained, with AdamW's state) and the reference's
(frozen: no gradient, no optimizer state), both filled from one SFT or pretrained run by
`init.path` with `init.into = "policy,ref"`. A batch holds pairs: `inputs`, `targets`,
`weights` of shape [B, 2, T], row 0 the prompt + chosen answer, row 1 the prompt +
rejected answer, rendered through the chat template (jtrain.data.chat) with weight 1 on
the answer's tokens only. The loss is -log sigmoid(beta * ((pi_c - ref_c) - (pi_r -
ref_r))), pi / ref the answer's summed log-probability under the policy / the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jtrain import losses
from jtrain.data import chat
from jtrain.errors import DataError
from jtrain.step import Context, Step, optimizer_update

MODEL = {"d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 128, "max_len": 64}


def encode_pairs(path: str, seq_len: int, template: str = chat.TEMPLATE,
                 tokenizer: str = "") -> dict:
    """The pairs of a JSONL file as arrays [N, 2, seq_len] (chosen, rejected)."""
    tok = chat.tokenizer(tokenizer)
    out: dict = {"inputs": [], "targets": [], "weights": []}
    for i, (prompt, *answers) in enumerate(chat.pairs(path), 1):
        rows = []
        for answer in answers:
            doc = chat.encode(chat.pieces([{"role": "user", "content": prompt},
                                           {"role": chat.ASSISTANT, "content": answer}],
                                          template), tok)
            n = len(doc["tokens"]) - 1
            if n > seq_len:
                raise DataError(f"{path}: pair {i}", f"{n + 1} tokens, more than "
                                f"seq_len + 1 = {seq_len + 1}")
            pad = (0, seq_len - n)
            rows.append((np.pad(doc["tokens"][:-1], pad), np.pad(doc["tokens"][1:], pad),
                         np.pad(doc["weights"][1:], pad)))
        for k, column in zip(("inputs", "targets", "weights"), zip(*rows, strict=True),
                             strict=True):
            out[k].append(np.stack(column))
    return {k: np.stack(v) for k, v in out.items()}


def make_data(path: str, eval_path: str = "", seq_len: int = 64,
              template: str = chat.TEMPLATE, tokenizer: str = ""):
    """data.source: the training pairs (and held-out ones from eval_path)."""
    train = encode_pairs(path, seq_len, template, tokenizer)
    if not eval_path:
        return train
    return {"train": train, "eval": encode_pairs(eval_path, seq_len, template, tokenizer)}


def make_model(sizes: dict | None = None):
    from jtrain.models import make_model as make

    return make({"name": "transformer", **MODEL, **(sizes or {})}, dtype=jnp.float32,
                param_dtype=jnp.float32)


def answer_logps(net, params, batch) -> jnp.ndarray:
    """Each answer's summed log-probability [B, 2] (weights from the batch)."""
    b, _, t = batch["inputs"].shape
    logits = net.apply({"params": params}, batch["inputs"].reshape(2 * b, t))
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)),
                               batch["targets"].reshape(2 * b, t)[..., None], -1)[..., 0]
    return (logp.reshape(b, 2, t) * batch["weights"]).sum(-1)


def make(model: dict | None = None, beta: float = 0.1, lr: float = 1e-3) -> Step:
    """step.factory: the transformer's sizes (model.* keys of the run it starts from),
    DPO's beta and the policy's learning rate."""
    net = make_model(model)
    tx = optax.adamw(lr, weight_decay=0.0)

    def init(rng, example):
        from flax import linen as nn

        params = net.init({"params": rng, "dropout": rng},
                          jnp.asarray(example["inputs"])[:1])["params"]
        return {"policy": params, "ref": params, "opt": tx.init(nn.unbox(params))}

    def rows(state, params, batch):
        """(per-pair loss [B], policy margin [B], implicit reward margin [B])."""
        pi = answer_logps(net, params, batch)
        ref = jax.lax.stop_gradient(answer_logps(net, state["ref"], batch))
        reward = beta * ((pi[:, 0] - ref[:, 0]) - (pi[:, 1] - ref[:, 1]))
        return -jax.nn.log_sigmoid(reward), pi[:, 0] - pi[:, 1], reward

    def update(state, batch, rng, context: Context):
        mask = losses.row_mask(batch)
        w = jnp.ones(batch["inputs"].shape[0]) if mask is None else mask
        mean = lambda v: (v * w).sum() / jnp.maximum(w.sum(), 1.0)  # noqa: E731

        def loss(params):
            per_pair, margin, reward = rows(state, params, batch)
            return mean(per_pair), (mean(margin), mean((reward > 0).astype(jnp.float32)))

        (value, (margin, acc)), grads = jax.value_and_grad(loss, has_aux=True)(
            state["policy"])
        policy, opt = optimizer_update(tx, grads, state["opt"], state["policy"],
                                       context.lr_factor)
        return ({"policy": policy, "ref": state["ref"], "opt": opt},
                {"loss": value, "margin": margin, "reward_accuracy": acc,
                 "grad_norm": optax.tree.norm(grads)})

    def evaluate(state, batch):
        per_pair, margin, _ = rows(state, state["policy"], batch)
        return jnp.stack([per_pair, margin], -1)  # [B, 2]

    return Step(init=init, update=update, evaluate=evaluate, name="dpo")


def eval_loss(outputs, batch):
    """loss.fn: the mean DPO loss of the pairs `evaluate` scored."""
    return outputs[..., 0].mean()
