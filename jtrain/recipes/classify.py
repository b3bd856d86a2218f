"""Recipe: binary classification of a real table (configs/recipes/classify.py).

The data is scikit-learn's copy of the Wisconsin diagnostic breast-cancer table (569
tumours, 30 features, 212 malignant / 357 benign), which ships inside the scikit-learn
wheel (`sklearn.datasets.load_breast_cancer`: no download). Split stratified by class,
20 % held out for eval with `split_seed`; features standardised with the training
part's mean and standard deviation. Label 1 = benign, as sklearn codes it.
"""

from __future__ import annotations

import numpy as np


def make_data(split_seed=0, eval_fraction=0.2):
    """data.source: {"train": (x, y), "eval": (x, y)} float32 features, int32 labels."""
    data = split(split_seed, eval_fraction)
    (x, _), (x_eval, _) = data["train"], data["eval"]
    print(f"recipe classify: scikit-learn breast cancer, {len(x)} train / "
          f"{len(x_eval)} eval tumours x {x.shape[1]} features (standardised); early "
          "stopping on eval/f1_macro", flush=True)
    return data


def split(split_seed=0, eval_fraction=0.2):
    """The table split and standardised, as `make_data` returns it (without its line)."""
    try:
        from sklearn.datasets import load_breast_cancer
    except ImportError:
        raise ImportError("the classify recipe reads scikit-learn's breast-cancer table: "
                          "pip install 'jtrain[recipes]'") from None
    table = load_breast_cancer()
    x, y = table.data.astype(np.float64), table.target.astype(np.int32)
    rng = np.random.default_rng(split_seed)
    held = np.zeros(len(y), bool)
    for c in np.unique(y):  # stratified: the same share of each class held out
        idx = rng.permutation(np.flatnonzero(y == c))
        held[idx[:round(eval_fraction * len(idx))]] = True
    mean, std = x[~held].mean(0), x[~held].std(0)
    x = ((x - mean) / std).astype(np.float32)
    return {"train": (x[~held], y[~held]), "eval": (x[held], y[held])}
