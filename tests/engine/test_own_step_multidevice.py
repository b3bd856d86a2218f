"""A step of your own on 8 devices (the suite's 8-device child): its state sharded over
the mesh, each update on the global batch, equal to numpy SGD as on one device."""

import jax
import pytest

from test_own_step import check_against_numpy

pytestmark = pytest.mark.multidevice


def test_own_step_on_8_devices_equals_numpy_sgd(tmp_path):
    assert jax.device_count() == 8
    check_against_numpy(tmp_path)
