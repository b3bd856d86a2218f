"""The feature-interaction table's generated cases that need 8 devices (the suite's
8-device child): trained on all 8, or stopped on 4 and resumed on 8 (elastic resume:
bitwise with determinism.topology_invariant, close without), each against its
uninterrupted run and a hand evaluation of the saved state."""

import jax
import pytest

from test_interactions import CASES, run_and_check

pytestmark = pytest.mark.multidevice
EIGHT = [c for c in CASES if "one device" not in c]


@pytest.mark.parametrize("case", EIGHT, ids=[f"case{i}" for i in range(len(EIGHT))])
def test_a_generated_case_on_8_devices(case, tmp_path, monkeypatch):
    assert jax.device_count() == 8
    run_and_check(case, tmp_path, monkeypatch)
