"""scikit-learn's 8x8 digits with the fixed train / eval split of `bench peers`' mlp case,
as numpy arrays: jtrain's `data.source` there. numpy and scikit-learn only: the jtrain
side reads the arrays as arrays (no torch in its process); peer_torch.py loads this file
by path and wraps the same arrays in a torch Dataset for the PyTorch sides.
"""

from __future__ import annotations

import numpy as np

SPLIT_SEED = 0
EVAL_SIZE = 297  # of the 1797 digits; the rest train


def arrays(split: str) -> tuple[np.ndarray, np.ndarray]:
    """(float32 [N, 64] in [0, 1], int64 [N] labels) of `split` ("train" or "eval")."""
    return _split(_load(), split)


def digits() -> dict:
    """jtrain's `data.source` for the mlp case: {"train": (x, y), "eval": (x, y)}."""
    data = _load()
    return {"train": _split(data, "train"), "eval": _split(data, "eval")}


def _load():
    from sklearn.datasets import load_digits

    return load_digits(return_X_y=True)


def _split(data, split: str) -> tuple[np.ndarray, np.ndarray]:
    x, y = data
    order = np.random.default_rng(SPLIT_SEED).permutation(len(y))
    idx = order[:EVAL_SIZE] if split == "eval" else order[EVAL_SIZE:]
    return (x[idx] / 16.0).astype(np.float32), y[idx].astype(np.int64)
