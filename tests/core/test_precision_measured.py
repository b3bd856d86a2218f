"""Precision that tells the truth: jtrain sets the compute dtype where a model exposes it
(a Linen `dtype` field, NNX layers' `dtype` attributes, a factory's `dtype` argument),
measures what the traced forward computes in, reports it in the header and summary, and
warns when the model's layers cast back to their own dtype."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jtrain
from jtrain import precision
from jtrain.models import adapters
from projects.precision_models import CastsBack, Honours  # float32 always; its dtype


class OwnDtypeEncoder(nnx.Module):
    """Casts to its own dtype (default float32): computes float32 unless it is set."""

    def __init__(self, rngs, dtype=jnp.float32):
        self.dtype = dtype
        self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (4, 8)))
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        h = x.astype(self.dtype) @ self.kernel[...].astype(self.dtype)
        return self.head(self.norm(h))


def factory(dtype=jnp.float32):  # model.factory with a dtype argument
    return Honours(dtype=dtype)


def _build(model, dtype="bfloat16", **model_cfg):
    cfg = jtrain.config.resolve({"data": {"batch_size": 4},
                                 "model": {"dtype": dtype, **model_cfg}})
    example = {"inputs": np.zeros(4, np.float32), "targets": np.int32(0)}
    return jtrain.build(cfg, sample=example["inputs"], eval_example=example, model=model)


@pytest.mark.parametrize("model", [OwnDtypeEncoder, Honours()], ids=["nnx-class", "linen"])
def test_the_policy_reaches_layers_that_expose_a_dtype(model):
    b = _build(model)
    assert dict(b.policy.matmuls) == {"bfloat16": 2}, b.policy.matmuls
    assert b.policy.describe() == ("params float32, compute bfloat16 "
                                   "(model: 2/2 matmuls bfloat16)")
    assert b.policy.warning() is None
    assert b.policy.record()["measured_matmuls"] == {"bfloat16": 2}


def test_an_nnx_instance_is_copied_and_its_norms_keep_their_dtype():
    model = OwnDtypeEncoder(nnx.Rngs(0))
    changed = adapters.with_compute_dtype(model, jnp.bfloat16)
    assert changed.dtype == jnp.bfloat16 and changed.head.dtype == jnp.bfloat16
    assert changed.norm.dtype is None  # model.keep_fp32 ("norm")
    assert model.dtype == jnp.float32 and model.head.dtype is None  # the user's unchanged
    assert dict(_build(model).policy.matmuls) == {"bfloat16": 2}


def test_a_model_that_casts_back_is_reported_and_warned_about():
    b = _build(CastsBack)
    assert b.policy.describe() == ("params float32, compute bfloat16 "
                                   "(model: 0/1 matmuls bfloat16; 1 float32)")
    assert b.policy.warning() == (
        "jtrain: warning: model.dtype=bfloat16, but the model computes 1 of 1 matmuls in "
        "float32: its layers set their own dtype; build it with dtype=..., or give "
        "model.factory a dtype argument")


def test_float16_on_a_float32_model_claims_no_loss_scale():
    b = _build(CastsBack, dtype="float16")
    assert not b.policy.dynamic_loss_scale
    assert "loss scale" not in b.policy.describe()
    assert float(b.init().loss_scale["scale"]) == 1.0
    honours = _build(OwnDtypeEncoder, dtype="float16")  # it computes float16: scaled
    assert honours.policy.dynamic_loss_scale
    assert honours.policy.describe().endswith("(model: 2/2 matmuls float16), "
                                              "dynamic loss scale")


def test_model_factory_gets_the_dtype_argument():
    cfg = {"name": "user", "factory": f"{__name__}:factory"}
    b = _build(None, **cfg)
    assert dict(b.policy.matmuls) == {"bfloat16": 2}


def test_built_in_transformer_and_float32_runs_are_measured():
    cfg = jtrain.config.resolve({"data": {"batch_size": 2, "seq_len": 8}, "model": {
        "dtype": "bfloat16", "d_model": 16, "num_heads": 2, "d_ff": 32, "max_len": 8}})
    tokens = np.zeros(8, np.int32)
    b = jtrain.build(cfg, sample=tokens, eval_example={"inputs": tokens,
                                                          "targets": tokens})
    # per layer q, k, v, scores, context, out, mlp in, mlp out; the tied logits
    assert dict(b.policy.matmuls) == {"bfloat16": 2 * 8 + 1}
    assert _build(Honours(), dtype="float32").policy.describe() == (
        "params float32, compute float32 (model: 2/2 matmuls float32)")


def test_matmuls_inside_sub_jaxprs_are_counted():
    def apply(params, x):
        body = jax.checkpoint(lambda h: h @ params["w"])
        h = jax.jit(body)(x)
        h, _ = jax.lax.scan(lambda c, _: (c @ params["w"].astype(jnp.bfloat16)
                                          .astype(c.dtype), None), h, None, length=3)
        return jax.lax.cond(True, lambda h: h @ params["w"], lambda h: h, h)

    p = {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)}
    x = jax.ShapeDtypeStruct((2, 4), jnp.float32)
    assert precision.matmul_dtypes(apply, p, x) == (("float32", 3),)
    half = precision.matmul_dtypes(lambda p, x: x.astype(jnp.float16) @ p["w"].astype(
        jnp.float16), p, x)
    assert half == (("float16", 1),)


def test_measured_keeps_an_explicit_loss_scale():
    policy = precision.make_policy({"dtype": "float16", "loss_scale": "dynamic"})
    kept = precision.measured(policy, (("float32", 3),), "dynamic")
    assert kept.dynamic_loss_scale and dataclasses.asdict(kept)["matmuls"]
