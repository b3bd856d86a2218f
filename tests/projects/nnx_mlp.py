"""A user's NNX model: 4 features -> 16 hidden -> 2 classes (tests copy this file into
their temp dir and import it as the user's own module: `from nnx_mlp import Model`)."""

from flax import nnx


class Model(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(4, 16, rngs=rngs)
        self.out = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))
