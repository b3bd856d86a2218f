"""A user's table for a built-in MLP (`data.source = "tabular:make"`, `data.kwargs` to
change it): `n` rows of `features` normal features, class 1 where the first is positive;
all rows train and the first `eval_rows` evaluate. Faults to train through: rows `bad`
overflow the loss, rows `missing` lose their second feature (NaN), rows `spike[0]` to
`spike[1]` have a loss far above the rest."""

import numpy as np


def make(n=64, features=4, eval_rows=16, bad=(), spike=(0, 0), missing=()):
    r = np.random.default_rng(0)
    x = r.normal(size=(n, features)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    x[list(bad)] = 3e38  # finite inputs whose loss overflows
    x[list(missing), 1] = np.nan  # a missing input: its batch's update is skipped
    x[spike[0]:spike[1]] *= 300.0  # a finite loss far above the rest
    return {"train": {"inputs": x, "targets": y},
            "eval": {"inputs": x[:eval_rows], "targets": y[:eval_rows]}}
