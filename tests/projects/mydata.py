"""A user's data module for `data.source = "mydata:make"` (`data.kwargs` picks the
sizes): `n` rows of `features` normal features whose class is how many of the first
`classes - 1` features are positive; the first `train` rows train, the rest evaluate
(`train=None`: all rows train and nothing is held out)."""

import numpy as np


def make(n=96, train=64, features=4, classes=2):
    r = np.random.default_rng(0)
    x = r.normal(size=(n, features)).astype(np.float32)
    y = (x[:, :classes - 1] > 0).sum(axis=1).astype(np.int32)
    if train is None:
        return {"inputs": x, "targets": y}
    return {"train": {"inputs": x[:train], "targets": y[:train]},
            "eval": {"inputs": x[train:], "targets": y[train:]}}
