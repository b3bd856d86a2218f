"""configs/gpt2_small.py (the GPU throughput run) and model.attention, checked on the CPU:
the config builds GPT-2 small's 124 M parameters, the MFU formula's N matches the real
parameter count, `auto` picks cuDNN's fused kernel only on a GPU with a 16-bit dtype, and
JAX's dot_product_attention (the call the cudnn path makes, here with its XLA
implementation) equals the written-out attention on the same q, k, v layout."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from jtrain import config as config_lib
from jtrain import models as models_lib
from jtrain.models import transformer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gpt2_config(variant=None):
    path = os.path.join(REPO, "configs", "gpt2_small.py")
    spec = importlib.util.spec_from_file_location("gpt2_small_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return config_lib.resolve(module.get_config(variant))


def test_gpt2_small_has_124m_params_and_the_formula_counts_them():
    cfg = _gpt2_config()
    model = models_lib.make_model(cfg.model, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    x = jax.ShapeDtypeStruct((1, cfg.data.seq_len), jnp.int32)
    shapes = jax.eval_shape(lambda t: model.init(jax.random.key(0), t), x)["params"]
    leaves = jax.tree.leaves(nn.unbox(shapes))
    total = sum(int(np.prod(leaf.shape)) for leaf in leaves)
    assert 123.5e6 < total < 124.5e6  # GPT-2 small: 124 M with tied embeddings
    assert {leaf.dtype for leaf in leaves} == {jnp.dtype(jnp.float32)}
    norms = (2 * cfg.model.num_layers + 1) * cfg.model.d_model  # scales, not in matmuls
    assert transformer.matmul_params(cfg.model) == total - norms
    flops = models_lib.flops_per_example(cfg.model, (1024,))
    assert flops == pytest.approx((6 * (total - norms) + 12 * 12 * 768 * 1024) * 1024)


@pytest.mark.parametrize("choice,dtype,platform,want", [
    ("auto", jnp.bfloat16, "gpu", "cudnn"), ("auto", jnp.float16, "gpu", "cudnn"),
    ("auto", jnp.float32, "gpu", "xla"), ("auto", jnp.bfloat16, "cpu", "xla"),
    ("auto", jnp.bfloat16, "tpu", "xla"), ("xla", jnp.bfloat16, "gpu", "xla"),
    ("cudnn", jnp.float32, "cpu", "cudnn"),
])
def test_attention_auto_choice(choice, dtype, platform, want):
    assert transformer.attention_impl(choice, dtype, platform) == want


def test_fused_attention_call_equals_written_out_attention():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 16, 4, 8)), jnp.float32) for _ in range(3))
    fused = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    np.testing.assert_allclose(np.asarray(fused), np.asarray(transformer._attend(q, k, v)),
                               rtol=1e-5, atol=1e-6)
    # causal: the first position attends only to itself
    np.testing.assert_allclose(np.asarray(fused[:, 0]), np.asarray(v[:, 0]), rtol=1e-6)


def test_attention_key_is_validated():
    cfg = _gpt2_config("debug")
    assert cfg.model.attention == "auto"
    bad = cfg.to_dict()
    bad["model"]["attention"] = "flash"
    with pytest.raises(config_lib.ConfigError, match="model.attention"):
        config_lib.resolve(bad)


def test_overhead_bench_has_gpt2_presets():
    from jtrain.bench import overhead as bo

    cfg = bo.bench_config("gpt2_debug", steps=2, log_every=1)
    assert (cfg.model.vocab_size, cfg.data.seq_len, cfg.total_steps) == (50304, 128, 3)
    full = bo.preset_config("gpt2")
    assert (full.model.num_layers, full.model.d_model, full.data.seq_len) == (12, 768, 1024)
