"""BatchNorm's running statistics on 8 devices (the suite's 8-device child): each step's
statistics are those of the global batch (the mean over the data-parallel devices), so
they equal the numpy recomputation and the 1-device run, and eval uses them."""

import jax
import numpy as np
import pytest

import jtrain
from test_model_state import MODELS, by_hand, config, data, numpy_stats, stats_of

pytestmark = pytest.mark.multidevice


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_running_statistics_on_8_devices(tmp_path, kind):
    assert jax.device_count() == 8
    train, ev = data(), data(100, seed=1)
    result = jtrain.train(config(), str(tmp_path), model=MODELS[kind](), train_data=train,
                          eval_data=ev)
    mean, var = stats_of(kind, result.state.model_state)
    want_mean, want_var = numpy_stats(tmp_path, train["inputs"])
    np.testing.assert_allclose(mean, want_mean, rtol=1e-5)
    np.testing.assert_allclose(var, want_var, rtol=1e-5)
    loss, accuracy = by_hand(kind, result.state, ev)
    np.testing.assert_allclose(result.history[-1]["eval/loss"], loss, rtol=1e-5)
    assert result.history[-1]["eval/accuracy"] == accuracy
