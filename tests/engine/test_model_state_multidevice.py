"""BatchNorm's running statistics on 8 devices (the suite's 8-device child): each step's
statistics are those of the global batch (the mean over the data-parallel devices), so
they equal the numpy recomputation and the 1-device run, and eval uses them."""

import jax
import pytest

from test_model_state import check_statistics_and_eval

pytestmark = pytest.mark.multidevice


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_running_statistics_on_8_devices(tmp_path, kind):
    assert jax.device_count() == 8
    check_statistics_and_eval(tmp_path, kind)
