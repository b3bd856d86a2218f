"""A user's Linen classifier: features -> `hidden` -> 2 classes (tests copy this file
into their temp dir and import it as the user's own module:
`from linen_classifier import Net`)."""

from flax import linen as nn


class Net(nn.Module):
    hidden: int = 8

    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(2)(nn.relu(nn.Dense(self.hidden)(x)))
