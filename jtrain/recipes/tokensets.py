"""Token sets and the set encoder shared by the masked-pretraining, fine-tuning and
set-completion recipes.

The data (`generate`), from `seed`: a vocabulary of PROGRAMS gene programs of PROGRAM_SIZE
tokens each plus BACKGROUND background tokens (ids from FIRST_TOKEN; 0 is padding, 1 the
[MASK] token). A set ("a cell") belongs to one program: its length is uniform in
[min_len, max_len]; each member is, with probability `signal`, a token of its program
(uniform over the program), else a background token (uniform), drawn without repeats;
sorted, padded with 0 to max_len. The program is the set's label. Every set also carries
its index `id` (the eval masks are keyed by it). Tokens of one program co-occur, which is
what masked pretraining can learn without labels and a classifier needs many labels to
learn from scratch.

`SetEncoder`: token embeddings (no positions: a set has no order), pre-LayerNorm
transformer blocks whose attention ignores padding, a masked mean over the members.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

PAD, MASK, FIRST_TOKEN = 0, 1, 2
PROGRAMS, PROGRAM_SIZE, BACKGROUND = 8, 12, 48
VOCAB = FIRST_TOKEN + PROGRAMS * PROGRAM_SIZE + BACKGROUND


def generate(n: int, seed: int, min_len=6, max_len=12, signal=0.5) -> dict:
    """{"tokens": int32 [n, max_len] (0-padded), "label": int32 [n], "id": int32 [n]}."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(PROGRAMS, size=n)
    tokens = np.zeros((n, max_len), np.int32)
    background = FIRST_TOKEN + PROGRAMS * PROGRAM_SIZE + np.arange(BACKGROUND)
    for i, program in enumerate(labels):
        own = FIRST_TOKEN + program * PROGRAM_SIZE + np.arange(PROGRAM_SIZE)
        length = rng.integers(min_len, max_len + 1)
        k = min(rng.binomial(length, signal), PROGRAM_SIZE)
        members = np.r_[rng.choice(own, k, replace=False),
                        rng.choice(background, length - k, replace=False)]
        tokens[i, :length] = np.sort(members)
    return {"tokens": tokens, "label": labels.astype(np.int32),
            "id": np.arange(n, dtype=np.int32)}


class Block(nn.Module):
    heads: int
    width: int

    @nn.compact
    def __call__(self, h, attend):                         # h [B, L, D], attend [B, 1, L, L]
        a = nn.MultiHeadDotProductAttention(self.heads, name="attn")(
            nn.LayerNorm()(h), mask=attend)
        h = h + a
        m = nn.Dense(self.width * 2, name="mlp_in")(nn.LayerNorm()(h))
        return h + nn.Dense(self.width, name="mlp_out")(nn.gelu(m))


class SetEncoder(nn.Module):
    """tokens [B, L] -> (members [B, L, D], pooled [B, D])."""
    width: int = 64
    layers: int = 2
    heads: int = 4

    @nn.compact
    def __call__(self, tokens):
        present = tokens != PAD                                             # [B, L]
        h = nn.Embed(VOCAB, self.width, name="embed")(tokens)
        attend = nn.make_attention_mask(present, present)                   # [B, 1, L, L]
        for i in range(self.layers):
            h = Block(self.heads, self.width, name=f"block_{i}")(h, attend)
        h = nn.LayerNorm(name="norm")(h)
        w = present[..., None].astype(h.dtype)
        pooled = (h * w).sum(1) / jnp.maximum(w.sum(1), 1.0)                # [B, D]
        return h, pooled
