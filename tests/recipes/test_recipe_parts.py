"""The recipes' own pieces in-process (tests/recipes/test_recipes.py runs each recipe as
its user does)."""

import jax
import numpy as np

from jtrain.recipes import imputation


def test_imputation_masks_in_graph_with_edge_cases():
    avail = np.array([[0] * 8, [0, 0, 1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0], [1] * 8],
                     np.float32)
    key = jax.random.key(3)
    hidden = np.asarray(imputation.hide_in_graph(key, avail))
    assert hidden[:2].sum() == 0                       # 0 or 1 available: nothing hidden
    assert hidden[2].sum() == 1 and hidden[3].sum() == 2  # max(1, round(0.25 n)), < n
    assert (hidden <= avail).all()                     # only available features hide
    np.testing.assert_array_equal(hidden, imputation.hide_in_graph(key, avail))
    other = np.asarray(imputation.hide_in_graph(jax.random.key(4), np.ones((64, 8))))
    assert not (other == other[0]).all()               # another step's key, other masks
    np.testing.assert_array_equal(imputation.hide_count(avail.sum(1)), [0, 0, 1, 2])
