"""A user's models for the precision report (`model.dtype`): `CastsBack`, an NNX layer
that casts back to float32 whatever jtrain asks (the warning's case), and `Honours`, a
Linen MLP that computes in its `dtype`; `make(dtype)` for `model.factory =
"precision_models:make"` (jtrain passes the policy's dtype) and `data()` for
`data.source = "precision_models:data"`."""

import jax.numpy as jnp
import numpy as np
from flax import linen as nn, nnx


class CastsBack(nnx.Module):
    """Casts to float32 whatever jtrain does: the warning's case."""

    def __init__(self, rngs):
        self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (4, 2)))

    def __call__(self, x):
        return x.astype(jnp.float32) @ self.kernel[...].astype(jnp.float32)


class Honours(nn.Module):
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, dtype=self.dtype)(nn.relu(nn.Dense(8, dtype=self.dtype)(x)))


def make(dtype=jnp.float32):
    return Honours(dtype=dtype)


def data():
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    return {"inputs": x, "targets": (x[:, 0] > 0).astype(np.int32)}
