"""numpy's own recomputation of the numbers jtrain logs, for the tests that compare them
(import it as a plain module: `from numpy_metrics import accuracies`)."""

import numpy as np


def accuracies(logits, targets, rows) -> tuple[float, float]:
    """(accuracy, top-2 accuracy) of `logits[rows]` against `targets[rows]`."""
    hits = logits[rows].argmax(-1) == targets[rows]
    label = np.take_along_axis(logits[rows], targets[rows][:, None], axis=-1)
    rank = (logits[rows] > label).sum(-1)
    return hits.mean(), (rank < 2).mean()
