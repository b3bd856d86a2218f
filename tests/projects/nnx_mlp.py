"""A user's NNX model: 4 features -> an `encoder` (16 hidden) -> a `head` (2 classes),
which fine-tuning tests freeze or adapt by name. Tests copy this file into their temp dir
and import it as the user's own module (`from nnx_mlp import Model`); `make()` is its
`model.factory = "nnx_mlp:make"` and `data()` its `data.source = "nnx_mlp:data"` (`n`
rows, class 1 where x0 + x1 > 0)."""

import numpy as np
from flax import nnx


class Model(nnx.Module):
    def __init__(self, rngs):
        self.encoder = nnx.Linear(4, 16, rngs=rngs)
        self.head = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.encoder(x)))


def make():
    return Model


def data(n=96):
    r = np.random.default_rng(0)
    x = r.normal(size=(n, 4)).astype(np.float32)
    return {"inputs": x, "targets": (x[:, 0] + x[:, 1] > 0).astype(np.int32)}
