"""8-bit quantised training through qwix (`model.quant`, jtrain/models/quant.py): the int8
forward of a Dense equals a hand int8 computation (numpy: per-channel weight scales,
per-row activation scales, an integer matmul, dequantised); a Linen and an NNX model
train (the loss falls), the summary counts their int8 matmuls and a run resumed from a
checkpoint ends on the uninterrupted run's state hash; the header line says which
matmuls run quantised; refused settings are one line each."""

import json

import jax
import numpy as np
import pytest
from flax import linen as nn

import jtrain
from jtrain import errors, precision
from test_lora import LinenNet, NnxNet, _data  # the same tiny Linen / NNX models

pytest.importorskip("qwix")


class Dense(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(3, use_bias=False, name="head")(x)


class NoMatmul(nn.Module):
    """Scales its inputs: no matmul for qwix to quantise."""

    @nn.compact
    def __call__(self, x, train=False):
        w = self.param("w", nn.initializers.ones, (4,))
        return (x * w)[:, :3]


def _cfg(total_steps=6, quant="int8", **extra):
    return {"total_steps": total_steps, "seed": 0, "data": {"batch_size": 32},
            "model": {"quant": quant}, "eval": {"every_steps": 0},
            "log": {"verbosity": 0, "writers": ("jsonl",), "every_steps": 1},
            "optim": {"name": "adamw", "lr": 0.05, "schedule": "constant"}, **extra}


def _hand_int8(x, w):
    """int8 per-row activations times int8 per-output-channel weights, dequantised:
    scale = absmax / 127.5 (qwix's symmetric bound: the top bucket is whole), values
    rounded half to even and clipped to [-128, 127]."""
    x, w = np.asarray(x, np.float32), np.asarray(w, np.float32)
    sx = np.abs(x).max(axis=1, keepdims=True) / np.float32(127.5)
    sw = np.abs(w).max(axis=0, keepdims=True) / np.float32(127.5)
    qx = np.clip(np.round(x / sx), -128, 127).astype(np.int32)
    qw = np.clip(np.round(w / sw), -128, 127).astype(np.int32)
    return (qx @ qw).astype(np.float64) * sx * sw


def _absmax_positive(a, axis):
    top = np.take_along_axis(a, np.abs(a).argmax(axis=axis, keepdims=True), axis=axis)
    return a * np.sign(top)


def test_the_int8_forward_of_a_dense_is_the_hand_int8_computation():
    data = _data()
    x = data["inputs"][:8]
    b = jtrain.build(jtrain.resolve(_cfg()), sample=x[0], model=Dense(),
                     eval_example={"inputs": x[0], "targets": data["targets"][0]})
    # The absmax element of each row (and weight column) lands on the tie 127.5, which
    # XLA's division puts a hair either side: a positive one saturates to 127 both ways,
    # a negative one is -127 or -128. Signs flipped so every absmax is positive.
    x = _absmax_positive(x, axis=1)
    params = b.init().params
    w = _absmax_positive(np.asarray(params["head"]["kernel"]), axis=0)
    params = {"head": {"kernel": jax.numpy.asarray(w)}}
    out = np.asarray(jax.jit(b.model_fns.apply)(params, x), np.float64)
    hand = _hand_int8(x, w)
    np.testing.assert_allclose(out, hand, rtol=1e-5, atol=1e-6)
    plain = x.astype(np.float64) @ w  # and it is not the float32 matmul
    assert np.abs(out - plain).max() > 1e-4


@pytest.mark.slow  # four short trainings (~2 CPU s each model)
@pytest.mark.parametrize("model", [LinenNet(), NnxNet], ids=["linen", "nnx"])
def test_a_quantised_run_trains_counts_its_int8_matmuls_and_resumes_bitwise(tmp_path,
                                                                          model):
    data = _data()
    one = jtrain.train(_cfg(), str(tmp_path / "one"), model=model, train_data=data)
    rows = (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()
    losses = [r["train/loss"] for r in map(json.loads, rows) if "train/loss" in r]
    assert len(losses) == 6 and max(losses[-2:]) < min(losses[:2]), losses
    header = (tmp_path / "one" / "train.log").read_text()
    assert "compute float32 (model: 2/2 matmuls int8)" in header
    record = json.loads((tmp_path / "one" / "summary.json").read_text())["precision"]
    assert record["measured_matmuls"] == {"int8": 2}, record
    two = str(tmp_path / "two")  # stopped after 3 steps, then resumed to 6
    jtrain.train(_cfg(total_steps=3), two, model=model, train_data=data)
    resumed = jtrain.train(_cfg(), two, model=model, train_data=data)
    assert resumed.summary["resumed_from"] == 3
    assert resumed.summary["state_sha256"] == one.summary["state_sha256"]
    with pytest.raises(errors.UsageError, match="trained with model.quant=int8: the "
                                                "decoder runs float matmuls"):
        jtrain.sample(str(tmp_path / "one"), ["ab"], model=model)
    plain = jtrain.train(_cfg(quant="none"), str(tmp_path / "plain"), model=model,
                         train_data=data)  # quantisation changes the trained bits
    assert plain.summary["state_sha256"] != one.summary["state_sha256"]


def test_the_header_says_which_matmuls_run_quantised():
    policy = precision.make_policy({"dtype": "float32"}, platform="cpu")
    assert precision.measured(policy, (("int8", 17),)).describe() == (
        "params float32, compute float32 (model: 17/17 matmuls int8)")
    mixed = precision.measured(policy, (("int8", 2), ("float32", 1)))
    assert mixed.describe() == "params float32, compute float32 (model: 2/3 matmuls " \
                               "int8; 1 float32)"
    bf16 = precision.measured(precision.make_policy({"dtype": "bfloat16"}, "cpu"),
                              (("int8", 2),))
    assert bf16.warning() is None  # quantised matmuls are not the layers' own dtype


def _refusal(tmp_path, cfg, model=None, **kwargs) -> str:
    with pytest.raises(errors.ConfigError) as e:
        jtrain.train(cfg, str(tmp_path / "run"), model=model or LinenNet(),
                     train_data=_data(), **kwargs)
    line = errors.render(e.value)
    assert "\n" not in line and not (tmp_path / "run" / "checkpoints").exists()
    return line


def test_a_model_of_which_qwix_quantises_nothing_is_refused_by_name(tmp_path):
    assert _refusal(tmp_path, _cfg(), NoMatmul()) == (
        "jtrain: config error: model.quant: int8: qwix intercepts none of the matmuls of "
        "model user NoMatmul (it quantises jax.lax.dot_general, jnp.einsum and "
        "convolutions inside Flax modules); set model.quant='none'")


def test_an_init_apply_pair_is_refused(tmp_path):
    inner = LinenNet()
    pair = (inner.init, inner.apply)
    line = _refusal(tmp_path, _cfg(quant="fp8"), pair)
    assert line.startswith("jtrain: config error: model.quant: model.quant=fp8 quantises "
                           "the matmul weights of Flax modules"), line


@pytest.mark.parametrize("extra,key", [
    ({"finetune": {"lora": {"rank": 2}}}, "finetune.lora.rank"),
    ({"population": {"size": 2}}, "population.size")])
def test_settings_it_does_not_compose_with_are_one_line(tmp_path, extra, key):
    line = _refusal(tmp_path, _cfg(**extra))
    assert line.startswith(f"jtrain: config error: model.quant: int8 is not supported "
                           f"with {key} ("), line
