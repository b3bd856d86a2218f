"""The pre-flight checks trace the model once per shape: build's checks and the eval's
metric choice ask for the outputs on the same shapes, and a second trace of the same
model on the same shapes gives nothing new. In process, with a model that counts its
traces."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtrain.data.items import DataError
from jtrain.engine import checks


def _counting_model():
    calls = []

    def apply(params, x, rng=None, train=False):
        calls.append(x.shape)
        if x.shape[-1] != params["w"].shape[0]:
            raise ValueError(f"wants {params['w'].shape[0]} features, got {x.shape[-1]}")
        return x @ params["w"]

    return apply, calls


def _spec(*shape, dtype=np.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_the_same_shapes_are_traced_once_and_other_shapes_again():
    apply, calls = _counting_model()
    params = {"w": _spec(4, 3)}
    first = checks.traced_outputs(apply, params, _spec(2, 4))
    assert first.shape == (2, 3) and len(calls) == 1
    # build's output shape, the eval's metric choice, the model check: one trace
    assert checks.output_shape_of(apply, params, _spec(2, 4)) == (3,)
    assert checks.traced_outputs(apply, {"w": _spec(4, 3)}, _spec(2, 4), "eval_data") is first
    assert len(calls) == 1
    # another batch size, input dtype, parameter shape or model: traced again
    assert checks.traced_outputs(apply, params, _spec(5, 4)).shape == (5, 3)
    assert checks.traced_outputs(apply, params, _spec(2, 4, dtype=jnp.bfloat16)).dtype == \
        jnp.result_type(jnp.bfloat16, np.float32)
    assert checks.traced_outputs(apply, {"w": _spec(4, 7)}, _spec(2, 4)).shape == (2, 7)
    assert len(calls) == 4
    other, other_calls = _counting_model()
    checks.traced_outputs(other, params, _spec(2, 4))
    assert len(other_calls) == 1 and len(calls) == 4


def test_a_failing_trace_is_not_kept():
    apply, calls = _counting_model()
    params = {"w": _spec(4, 3)}
    for _ in range(2):  # each call traces and fails with the split it names
        with pytest.raises(DataError, match="eval_data's inputs.*wants 4 features"):
            checks.traced_outputs(apply, params, _spec(2, 5), "eval_data")
    assert len(calls) == 2
