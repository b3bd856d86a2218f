"""A user's model module for `model.factory = "mymodels:make"`: `make(hidden, dtype,
features, classes)` returns how to build their NNX `Net` (`features` -> `hidden` ->
`classes`, in `dtype`) and notes each dtype it was given in `seen`; `LinenNet` is the
Linen classifier they pass from Python. In-process tests import it as
`projects.mymodels`."""

import jax.numpy as jnp
from flax import linen as nn, nnx

seen = []


class Net(nnx.Module):
    def __init__(self, hidden, rngs, dtype=jnp.float32, features=4, classes=2):
        self.body = nnx.Linear(features, hidden, rngs=rngs, dtype=dtype)
        self.head = nnx.Linear(hidden, classes, rngs=rngs, dtype=dtype)

    def __call__(self, x):
        return self.head(nnx.relu(self.body(x)))


def make(hidden=8, dtype=jnp.float32, features=4, classes=2):
    seen.append(dtype)
    return lambda rngs: Net(hidden, rngs, dtype, features, classes)


class LinenNet(nn.Module):
    hidden: int = 8

    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(2)(nn.relu(nn.Dense(self.hidden)(x)))
