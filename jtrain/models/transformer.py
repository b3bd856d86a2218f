"""Decoder-only transformer language model over bytes or tokens.

Pre-norm blocks (RMSNorm -> causal self-attention -> residual, RMSNorm -> MLP ->
residual; `model.mlp`: "gelu" = up, GELU, down; "swiglu" = down(silu(gate) * up), the
Llama MLP; jtrain.checkpoint.hf maps both to Hugging Face architectures), rotary position embeddings
(no position parameters, so nothing to resize), no biases, a final RMSNorm and an output projection
that is the embedding table when `tie_embeddings` is on.

Precision: parameters are stored in `param_dtype`; every matmul runs in `dtype`; norms,
the softmax and the returned logits are float32.

Decoding (jtrain.engine.sample): `init_cache(batch, length)` is an empty key/value cache
and `__call__(tokens, cache=cache, pad=pad)` runs `tokens` [B, T] at the cache's index,
rows left-padded by `pad` [B] tokens, returning the logits and the cache written at
those T slots: the prompt in one call (prefill), then one token per call.

Memory: `model.remat` rematerialises each block (REMAT_POLICIES): the backward pass
recomputes what the policy did not keep, trading compute for activation memory.

Every parameter carries logical axis names from `jtrain.mesh.LOGICAL_RULES`:
  embedding            [V, D]      ("vocab", "embed")
  query/key/value      [D, H, Dh]  ("embed", "heads", "kv")
  attention out        [H, Dh, D]  ("heads", "kv", "embed")
  mlp in (and gate)    [D, F]      ("embed", "mlp")
  mlp out              [F, D]      ("mlp", "embed")
  untied logits        [D, V]      ("embed", "vocab")
  norm scales          [D]         ("norm",)
  router (model.moe)   [D, E]      ("embed", None)
  expert in (and gate) [E, D, F]   ("expert", None, "mlp")
  expert out           [E, F, D]   ("expert", "mlp", None)

`model.moe.experts` > 0 replaces the MLP of every `model.moe.every`-th block (counted
from the last) by MoeBlock: top-k routed experts (jtrain.models.moe).

`stages` > 1 (mesh.stage) runs the blocks as a pipeline: `Stage`s of num_layers / stages
blocks, parameters stacked under "pipeline" on a leading "stage" dimension
(`stack_layers` maps a plain model's), microbatches run by the GPipe schedule
(`Transformer._pipeline`, docs/guide/scaling-out.md).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from jtrain import mesh as mesh_lib
from jtrain.models import moe as moe_lib


Dtype = Any


def _param(module: nn.Module, name: str, shape, axes, init):
    """A parameter in module.param_dtype annotated with logical `axes`.

    At use, the "embed" dimension is gathered (FSDP: parameters are stored sharded and
    all-gathered for the matmul, activations stay split by batch). A no-op unless the
    engine sets logical-axis rules."""
    w = module.param(name, nn.with_logical_partitioning(init, axes), shape, module.param_dtype)
    return nn.with_logical_constraint(w, tuple(None if a == "embed" else a for a in axes))


def _matmul(x: jax.Array, w: jax.Array, n_in: int = 1) -> jax.Array:
    """x [..., K1..Kn] times w [K1..Kn, M...] -> [..., M...] with x's leading dims
    flattened into one: a matmul over [N, K1..Kn], N = B*T.

    The same contraction an einsum over [B, T, ...] writes, but its weight gradient
    then contracts over one dimension N rather than two (B and T), and XLA:CPU forms it
    from the activations as they are laid out; with the einsum over [B, T, ...] it wrote
    transposed copies of the activations and of their gradients first (`docs/
    benchmarks.md`, "Where the base model's step goes on CPU"). Sharding is unchanged:
    B is the major part of N. On a mesh that splits the sequence (mesh.context > 1) the
    leading dims stay as they are: a row's tokens are not contiguous in N when B is not
    split as finely, and the flattened matmul would gather the whole sequence."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.shape.get("context", 1) > 1:
        contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
        return jax.lax.dot_general(x, w, (contract, ((), ())))
    lead = x.shape[:x.ndim - n_in]
    x2 = x.reshape((-1,) + x.shape[x.ndim - n_in:])  # [N, K1..Kn]
    contract = (tuple(range(1, n_in + 1)), tuple(range(n_in)))
    y = jax.lax.dot_general(x2, w, (contract, ((), ())))  # [N, M...]
    return y.reshape(lead + w.shape[n_in:])


def _norm(param_dtype: Dtype, name: str) -> nn.RMSNorm:
    # Norms compute in float32 whatever the compute dtype: bf16 mean-squares are too coarse.
    return nn.RMSNorm(dtype=jnp.float32, param_dtype=param_dtype, name=name,
                      scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("norm",)))


def _rope(x: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    """Rotary position embedding over the last axis of x [B, T, H, Dh], in float32;
    `positions` [B, T] (packed sequences: from 0 in each segment), else 0..T-1."""
    _, t, _, dh = x.shape
    half = dh // 2
    freq = 1.0 / (10_000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))  # [Dh/2]
    pos = (jnp.arange(t, dtype=jnp.float32)[None, :] if positions is None
           else positions.astype(jnp.float32))  # [B or 1, T]
    angle = pos[:, :, None] * freq[None, None, :]  # [B or 1, T, Dh/2]
    sin = jnp.sin(angle)[:, :, None, :]  # [B or 1, T, 1, Dh/2]
    cos = jnp.cos(angle)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # [B, T, H, Dh/2] each
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class CausalSelfAttention(nn.Module):
    num_heads: int
    dtype: Dtype
    param_dtype: Dtype
    attention: str = "xla"  # "xla": written out below; "cudnn": fused (flash) kernel

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None, cache=None):  # x [B, T, D]
        """[B, T, D]; with `cache` = (this layer's {"key", "value"} [B, S, H, Dh], the
        slot of x's first token, the mask [B, 1, T, S]): ([B, T, D], the layer's cache
        with x's keys and values written)."""
        d = x.shape[-1]
        h, dh = self.num_heads, d // self.num_heads
        in_init = nn.initializers.lecun_normal(in_axis=0, out_axis=(1, 2))
        out_init = nn.initializers.lecun_normal(in_axis=(0, 1), out_axis=2)
        x = x.astype(self.dtype)
        q, k, v = (_matmul(x, _param(self, name, (d, h, dh), ("embed", "heads", "kv"),
                                     in_init).astype(self.dtype))  # [B, T, H, Dh]
                   for name in ("query", "key", "value"))
        q, k = _rope(q, positions), _rope(k, positions)
        if cache is not None:
            kv, index, allowed = cache
            kv = {name: jax.lax.dynamic_update_slice(kv[name], new.astype(kv[name].dtype),
                                                     (0, index, 0, 0))  # [B, S, H, Dh]
                  for name, new in (("key", k), ("value", v))}
            ctx = _attend(q, kv["key"], kv["value"], allowed=allowed)
        else:  # mesh.context: queries stay split by length, keys and values are
            # gathered whole (a no-op unless the engine sets logical-axis rules)
            k, v = (nn.with_logical_constraint(a, ("batch", None, "heads", "kv"))
                    for a in (k, v))
            if segment_ids is not None:  # packed: no attention across documents
                ctx = _attend(q, k, v, segment_ids)
            elif self.attention == "cudnn":
                # cuDNN's fused causal attention: the [B, H, T, T] scores never reach memory.
                ctx = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                   implementation="cudnn")  # [B, T, H, Dh]
            else:
                ctx = _attend(q, k, v)
        w_out = _param(self, "out", (h, dh, d), ("heads", "kv", "embed"), out_init)
        out = _matmul(ctx, w_out.astype(self.dtype), n_in=2)  # [B, T, D]
        return out if cache is None else (out, kv)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array,
            segment_ids: jax.Array | None = None, allowed=None) -> jax.Array:
    """Causal softmax attention written out; q [B, T, H, Dh], k, v [B, S, H, Dh] ->
    [B, T, H, Dh]. Scores and the softmax in float32. With `segment_ids` [B, T] a query
    sees only keys of its own segment; `allowed` [B, 1, T, S] (decoding from a cache):
    which keys each query sees, in place of the causal mask."""
    dh, dtype = q.shape[-1], q.dtype
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k).astype(jnp.float32)  # [B, H, T, S]
    scores = scores / jnp.sqrt(jnp.float32(dh))
    if allowed is None:
        t = q.shape[1]
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))  # [T, T]: query q sees keys s <= q
        allowed = causal[None, None]  # [1, 1, T, T]
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, T, T]
        allowed = allowed & same[:, None]  # [B, 1, T, T]
    scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)  # [B, H, T, T]
    return jnp.einsum("bhqs,bshk->bqhk", probs, v)  # [B, T, H, Dh]


MLP_KINDS = ("gelu", "swiglu")  # model.mlp


class MlpBlock(nn.Module):
    d_ff: int
    dtype: Dtype
    param_dtype: Dtype
    kind: str = "gelu"  # MLP_KINDS

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array:  # x [B, T, D]
        d = x.shape[-1]
        init = nn.initializers.lecun_normal()
        w_in = _param(self, "wi", (d, self.d_ff), ("embed", "mlp"), init)
        w_out = _param(self, "wo", (self.d_ff, d), ("mlp", "embed"), init)
        x = x.astype(self.dtype)
        h = _matmul(x, w_in.astype(self.dtype))  # [B, T, F]
        if self.kind == "swiglu":  # created after wi, wo: the GELU MLP's init is unchanged
            w_gate = _param(self, "wi_gate", (d, self.d_ff), ("embed", "mlp"), init)
            h = nn.silu(_matmul(x, w_gate.astype(self.dtype))) * h
        else:
            h = nn.gelu(h)  # the tanh approximation (flax's default)
        return _matmul(h, w_out.astype(self.dtype))  # [B, T, D]


class MoeBlock(nn.Module):
    """`experts` MLPs of MLP_KINDS `kind`; each token runs through its top `k`
    (jtrain.models.moe.route), their outputs weighted by the renormalised gates."""
    experts: int
    k: int
    capacity_factor: float
    d_ff: int
    dtype: Dtype
    param_dtype: Dtype
    kind: str = "gelu"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # x [B, T, D]
        d, e, f = x.shape[-1], self.experts, self.d_ff
        init = nn.initializers.lecun_normal(batch_axis=(0,))
        router = _param(self, "router", (d, e), ("embed", None), nn.initializers.lecun_normal())
        w_in = _param(self, "wi", (e, d, f), ("expert", None, "mlp"), init)
        w_out = _param(self, "wo", (e, f, d), ("expert", "mlp", None), init)
        tokens = x.reshape(-1, d)  # [N, D] float32
        w_gate = (_param(self, "wi_gate", (e, d, f), ("expert", None, "mlp"), init)
                  if self.kind == "swiglu" else None)
        logits = _matmul(tokens, router.astype(jnp.float32))  # [N, E]
        mesh = jax.sharding.get_abstract_mesh()
        args = (tokens, logits, (w_in, w_gate, w_out), self.k, self.capacity_factor,
                self.kind, self.dtype)
        if not mesh.empty and mesh.shape.get("expert", 1) > 1:
            y, balance, dropped = moe_lib.expert_parallel(*args, mesh)
        else:
            y, balance, dropped = moe_lib.run_experts(*args, lambda xs: nn.with_logical_constraint(
                xs, ("expert", None, None)))  # [E, C, D]
        self.sow("intermediates", "moe_aux", moe_lib.balance_loss(balance))
        self.sow("intermediates", "moe_dropped", dropped)
        self.sow("intermediates", "moe_assigned", jnp.float32(tokens.shape[0] * self.k))
        return y.reshape(x.shape)  # [B, T, D]


class Block(nn.Module):
    num_heads: int
    d_ff: int
    dropout: float
    dtype: Dtype
    param_dtype: Dtype
    attention: str = "xla"
    mlp: str = "gelu"  # MLP_KINDS
    moe: tuple = ()  # (experts, k, capacity_factor) for a MoeBlock; () = dense

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, segment_ids=None,
                 positions=None, cache=None):  # x [B, T, D]
        h = _norm(self.param_dtype, "attn_norm")(x)  # float32 [B, T, D]
        h = CausalSelfAttention(self.num_heads, self.dtype, self.param_dtype,
                                self.attention, name="attn")(h, segment_ids, positions,
                                                             cache)
        if cache is not None:  # (out, this layer's cache)
            h, cache = h
        x = x + _dropout(h, self.dropout, train)
        h = _norm(self.param_dtype, "mlp_norm")(x)
        if self.moe:
            h = MoeBlock(*self.moe, self.d_ff, self.dtype, self.param_dtype, self.mlp,
                         name="moe")(h)
        else:
            h = MlpBlock(self.d_ff, self.dtype, self.param_dtype, self.mlp, name="mlp")(h)
        x = x + _dropout(h, self.dropout, train)  # [B, T, D]
        return x if cache is None else (x, cache)


# model.remat: what a block keeps from the forward pass for the backward pass. "full"
# keeps only its input and recomputes the rest; the dots_* policies keep matmul outputs
# (those without batch dimensions: the weight matmuls, not attention's).
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable":
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def block_class(remat: str) -> type[nn.Module]:
    """Block, rematerialised per `remat` (REMAT_POLICIES); parameter names unchanged."""
    if remat == "none":
        return Block
    return nn.remat(Block, policy=REMAT_POLICIES[remat], static_argnums=(2,))  # train


def _dropout(x: jax.Array, rate: float, train: bool) -> jax.Array:
    if train and rate > 0:
        return nn.Dropout(rate, deterministic=False)(x)  # draws from the "dropout" rng
    return x


class Transformer(nn.Module):
    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    d_ff: int
    max_len: int
    dropout: float
    tie_embeddings: bool
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "xla"
    remat: str = "none"  # REMAT_POLICIES
    mlp: str = "gelu"  # MLP_KINDS
    moe: tuple = ()  # (experts, k, capacity_factor, every); () = dense MLPs
    stages: int = 1  # mesh.stage: > 1 runs the blocks as a pipeline (Stage, gpipe)
    microbatches: int = 1  # mesh.microbatches

    def init_cache(self, batch: int, length: int) -> dict:
        """An empty decoding cache of `length` <= max_len slots for `batch` rows: the
        next slot ("index") and each layer's keys and values [B, S, H, Dh] in dtype."""
        if length > self.max_len:
            raise ValueError(f"model.max_len: a cache of {length} tokens, the model's "
                             f"context is {self.max_len}")
        kv = jnp.zeros((batch, length, self.num_heads, self.d_model // self.num_heads),
                       self.dtype)
        return {"index": jnp.zeros((), jnp.int32),
                "layers": [{"key": kv, "value": kv} for _ in range(self.num_layers)]}

    @nn.compact
    def __call__(self, tokens, *, train: bool = False, cache=None, pad=None):
        """tokens int [B, T] with T <= max_len -> logits float32 [B, T, vocab_size].
        Packed sequences: tokens = {"inputs": [B, T], "segment_ids": [B, T] (attention
        stays within a segment), "positions": [B, T] (rotary positions per segment)}.
        Decoding: `cache` (init_cache) and `pad` int [B], the left padding of each row
        -> (logits, the cache with these T tokens written at its index)."""
        segment_ids = positions = decode = None
        if isinstance(tokens, dict):
            segment_ids, positions = tokens.get("segment_ids"), tokens.get("positions")
            tokens = tokens["inputs"]
        if cache is not None:
            index, slots = cache["index"], cache["layers"][0]["key"].shape[1]
            pad = jnp.zeros(tokens.shape[:1], jnp.int32) if pad is None else pad
            here = index + jnp.arange(tokens.shape[1])  # [T]: the tokens' slots
            positions = jnp.maximum(here[None, :] - pad[:, None], 0)  # [B, T]
            keys = jnp.arange(slots)  # [S]
            allowed = ((keys[None, :] <= here[:, None])[None]  # [1, T, S]: causal
                       & (keys[None, None, :] >= pad[:, None, None]))  # no padding
            decode = (index, allowed[:, None])  # [B, 1, T, S]
        if tokens.ndim != 2 or tokens.shape[1] > self.max_len:
            raise ValueError(f"model.max_len: expected tokens [batch, length<={self.max_len}], "
                             f"got shape {tokens.shape}")
        embed = nn.Embed(
            self.vocab_size, self.d_model, dtype=self.dtype, param_dtype=self.param_dtype,
            embedding_init=nn.with_logical_partitioning(
                nn.initializers.normal(stddev=self.d_model ** -0.5), ("vocab", "embed")),
            name="embed")
        x = embed(tokens)  # [B, T, D] in dtype
        x = _dropout(x, self.dropout, train)
        block = block_class(self.remat)
        layers = []
        if self.stages > 1:
            if decode is not None:
                raise ValueError("mesh.stage: a pipelined model does not decode from a cache")
            x = self._pipeline(x, train, segment_ids, positions)
        for i in range(self.num_layers if self.stages == 1 else 0):
            # Keep the residual stream split by batch only: with params sharded on
            # "embed" (FSDP), XLA would otherwise reshard activations along D instead of
            # gathering the weights. A no-op unless the engine sets logical-axis rules.
            x = nn.with_logical_constraint(x, ("batch", "length", None))
            x = block(self.num_heads, self.d_ff, self.dropout, self.dtype, self.param_dtype,
                      self.attention, mlp=self.mlp, moe=_moe_of(self.moe, i, self.num_layers),
                      name=f"layer_{i}")(
                x, train, segment_ids, positions,
                None if decode is None else (cache["layers"][i], *decode))
            if decode is not None:
                x, kv = x
                layers.append(kv)
        x = nn.with_logical_constraint(x, ("batch", "length", None))
        x = _norm(self.param_dtype, "final_norm")(x)  # float32 [B, T, D]
        if self.tie_embeddings:
            table = jnp.asarray(embed.embedding, self.dtype)  # [V, D]: what attend() uses
            logits = _matmul(x.astype(self.dtype), table.T)  # [B, T, V]
        else:
            w = _param(self, "logits", (self.d_model, self.vocab_size), ("embed", "vocab"),
                       nn.initializers.lecun_normal())
            logits = _matmul(x.astype(self.dtype), w.astype(self.dtype))
        logits = nn.with_logical_constraint(logits.astype(jnp.float32),
                                            ("batch", "length", "vocab"))  # [B, T, V]
        if decode is None:
            return logits
        return logits, {"index": decode[0] + tokens.shape[1], "layers": layers}


    def _pipeline(self, x, train, segment_ids, positions):
        """The blocks as `stages` stages of num_layers / stages blocks each, their
        parameters stacked on a leading stage dimension (logical axis "stage"), run on
        `microbatches` microbatches by the GPipe schedule (`jtrain.mesh.gpipe`): a buffer
        [stages, rows, T, D] holds each stage's input; every iteration runs all stages
        at once (vmap, each stage on the devices of its "stage" coordinate) and shifts
        the buffer one stage on (a collective permute over "stage")."""
        b, t, d = x.shape
        s, m = self.stages, math.gcd(b, self.microbatches)  # a batch of 1 (init): 1
        run = nn.vmap(Stage, variable_axes={"params": 0}, in_axes=0, spmd_axis_name="stage",
                      split_rngs={"params": True, "dropout": True},
                      metadata_params={nn.PARTITION_NAME: "stage"})(
            self.num_layers // s, (self.num_heads, self.d_ff, self.dropout, self.dtype,
                                   self.param_dtype, self.attention, self.mlp),
            self.remat, train, name="pipeline")
        # Row i * m + j of the batch is row i of microbatch j: each microbatch keeps the
        # batch's split over data x fsdp.
        split = lambda a: None if a is None else a.reshape(b // m, m, *a.shape[1:])  # noqa: E731
        xs, segs, pos = split(x), split(segment_ids), split(positions)
        buffer = jnp.zeros((s, b // m, t, d), x.dtype)
        outs = []
        for it, row in enumerate(mesh_lib.gpipe(m, s)):
            first = xs[:, it] if it < m else jnp.zeros_like(xs[:, 0])
            buffer = jnp.concatenate([first[None], buffer[:-1]])  # one stage on
            buffer = nn.with_logical_constraint(buffer, ("stage", "batch", "length", None))
            which = [max(j, 0) for j in row]  # idle stages read microbatch 0, unused
            buffer = run(buffer, *(None if a is None else jnp.moveaxis(a[:, which], 1, 0)
                                   for a in (segs, pos)))
            if row[-1] >= 0:
                outs.append(buffer[-1])  # microbatch row[-1] leaves the last stage
        return jnp.stack(outs, axis=1).reshape(b, t, d)


class Stage(nn.Module):
    """`layers` consecutive blocks of a pipeline; `block`: Block's fields up to `mlp`."""
    layers: int
    block: tuple
    remat: str
    train: bool

    @nn.compact
    def __call__(self, x, segment_ids=None, positions=None):  # x [B, T, D]
        for j in range(self.layers):
            x = nn.with_logical_constraint(x, ("batch", "length", None))
            x = block_class(self.remat)(*self.block[:6], mlp=self.block[6],
                                        name=f"layer_{j}")(x, self.train, segment_ids,
                                                           positions)
        return x


def stack_layers(params: dict, stages: int) -> dict:
    """A plain model's params (layer_0 .. layer_{L-1}) in the pipelined layout: layer
    k * L / stages + j is pipeline/layer_j[k]."""
    layers = sorted((k for k in params if k.startswith("layer_")), key=lambda k: int(k[6:]))
    per = len(layers) // stages
    out = {k: v for k, v in params.items() if not k.startswith("layer_")}
    out["pipeline"] = {f"layer_{j}": jax.tree.map(
        lambda *a: jnp.stack(a), *[params[layers[k * per + j]] for k in range(stages)])
        for j in range(per)}
    return out


def _moe_of(moe: tuple, layer: int, layers: int) -> tuple:
    """Block `layer`'s (experts, k, capacity_factor): every `every`-th block counted
    from the last is a MoeBlock; () for a dense one."""
    if not moe or (layers - 1 - layer) % moe[3]:
        return ()
    return moe[:3]


def moe_layers(model_cfg) -> int:
    """How many blocks are MoeBlocks (0: model.moe.experts = 0)."""
    m, layers = model_cfg["moe"], int(model_cfg["num_layers"])
    return 0 if not m["experts"] else len(range(layers - 1, -1, -int(m["every"])))


def build(model_cfg, *, dtype, param_dtype) -> Transformer:
    """A Transformer from a validated `model` section (jtrain.config.resolve_model)."""
    c = model_cfg
    return Transformer(
        vocab_size=int(c["vocab_size"]), d_model=int(c["d_model"]),
        num_layers=int(c["num_layers"]), num_heads=int(c["num_heads"]), d_ff=int(c["d_ff"]),
        max_len=int(c["max_len"]), dropout=float(c["dropout"]),
        tie_embeddings=c["tie_embeddings"], dtype=dtype, param_dtype=param_dtype,
        attention=attention_impl(c.get("attention", "auto"), dtype),
        remat=c.get("remat", "none"), mlp=c.get("mlp", "gelu"), moe=_moe_config(c))


def _moe_config(c) -> tuple:
    m = c.get("moe") or {}
    if not m.get("experts"):
        return ()
    return (int(m["experts"]), int(m["k"]), float(m["capacity_factor"]), int(m["every"]))


def attention_impl(choice: str, dtype, platform: str | None = None) -> str:
    """model.attention -> "xla" or "cudnn". auto: cuDNN's fused kernel on a GPU with a
    16-bit compute dtype (what it supports), the written-out attention elsewhere."""
    if choice != "auto":
        return choice
    platform = platform or jax.default_backend()
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if platform == "gpu" and half else "xla"


def matmul_params(model_cfg) -> int:
    """N: parameters that take part in a matmul per token.

    = L * (4*D^2 + 2*D*F)  (q, k, v, out; mlp in, mlp out; 3*D*F with the swiglu gate)
      + D*V                (the output projection; tied or not, the logits matmul is real
                            work, while the embedding lookup itself costs nothing)
    Norm scales (a few D-vectors) are left out. A MoE block (model.moe) counts its k
    active experts' MLPs and its router (D*E) in place of the dense MLP.
    """
    c = model_cfg
    d, f, v, layers = c["d_model"], c["d_ff"], c["vocab_size"], c["num_layers"]
    mlp_mats = 3 if c.get("mlp", "gelu") == "swiglu" else 2
    dense = int(layers * (4 * d * d + mlp_mats * d * f) + d * v)
    moe = c.get("moe") or {}
    if not moe.get("experts"):
        return dense
    routed = moe_layers(c) * ((int(moe["k"]) - 1) * mlp_mats * d * f + d * moe["experts"])
    return dense + routed


def flops_per_example(model_cfg, input_shape) -> float:
    """Training FLOPs (forward + backward) for one example of shape `input_shape` = (T,).

    Per token: 6*N + 12*L*D*T (Kaplan et al. 2020, attention scores and context at full
    T, not halved for the causal mask), with N = `matmul_params` (non-embedding params
    plus the D*V output projection, counted even when tied). Times T tokens.
    """
    c = model_cfg
    if isinstance(input_shape, dict):  # packed: {"inputs": (T,), "segment_ids": ...}
        input_shape = input_shape["inputs"]
    t = int(input_shape[-1])
    per_token = 6 * matmul_params(model_cfg) + 12 * c["num_layers"] * c["d_model"] * t
    return float(per_token * t)
