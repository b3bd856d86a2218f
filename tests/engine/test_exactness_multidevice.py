"""The exactness rows that depend on how eval batches are split, on 8 devices (the
suite's 8-device child): batch-scope eval is count-weighted and never scores padding,
and the default loss with element-wise weights is the numpy value, whatever the split."""

import jax
import numpy as np
import pytest

from test_exactness import OUT, cfg, data, err2, final_eval

pytestmark = pytest.mark.multidevice


@pytest.mark.parametrize("n", [1, 15, 17, 52])  # 1, batch - 1, batch + 1, 3 * batch + 4
def test_batch_scope_exact_on_8_devices(tmp_path, n):
    assert jax.device_count() == 8
    ev = data(n, seed=11)

    def loss_fn(out, batch):
        e = (out - batch["targets"]) ** 2
        return e.mean(), {"first": e[:, 0].mean()}

    got = final_eval(tmp_path, cfg(batch=16, loss={"eval_scope": "batch"}), ev,
                     loss_fn=loss_fn)
    np.testing.assert_allclose(got["eval/loss"], err2(ev).mean(), rtol=2e-6)
    np.testing.assert_allclose(got["eval/first"], err2(ev)[:, 0].mean(), rtol=2e-6)


def test_elementwise_weights_on_8_devices(tmp_path):
    ev = data(21, seed=12)
    w = (np.random.default_rng(12).random((21, OUT)) > 0.3).astype(np.float32)
    d = {"inputs": ev["x"], "targets": ev["targets"], "weights": w}
    got = final_eval(tmp_path, cfg(batch=16), d, train_data=d)
    np.testing.assert_allclose(got["eval/loss"], (err2(ev) * w).sum() / w.sum(), rtol=2e-6)
