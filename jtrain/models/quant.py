"""model.quant: 8-bit quantised training through qwix's quantised training (QtProvider).

`int8`: every matmul qwix intercepts (jax.lax.dot_general, jnp.einsum, convolutions:
flax's Dense / DenseGeneral / Einsum / Conv, nnx.Linear, the built-in transformer)
quantises its weight to int8 per output channel and its activation to int8 per row
(scale = absmax over the contracted axes / 127.5, rounded half to even, clipped to
[-128, 127]), multiplies in integers
(int32 accumulation) and dequantises; the backward pass is straight-through, from the
unquantised operands. `fp8`: the same with float8_e4m3fn operands and the gradients
quantised to float8_e5m2 in the backward matmuls.

Scales are computed from each batch (current scaling): no delayed-scaling statistics,
so the train state is the plain model's and a resumed run is bitwise the uninterrupted
one. The header counts the quantised matmuls in the traced forward
(precision.matmul_dtypes); a model of which qwix quantises none is refused, named.
"""

from __future__ import annotations

from jtrain import internals, precision
from jtrain.errors import ConfigError
from jtrain.models import adapters, lora

# model.quant -> (weight / activation dtype, gradient dtype in the backward matmuls)
_QTYPES = {"int8": ("int8", None), "fp8": ("float8_e4m3fn", "float8_e5m2")}
# Settings it does not compose with: (key, off test, why).
_REFUSED = (
    ("finetune.lora.rank", lambda c: not c.finetune.lora.rank,
     "LoRA's adapters and quantised matmuls are two qwix interceptions of one matmul"),
    ("population.size", lambda c: c.population.size <= 1,
     "not implemented for a population"),
)


def to_model_fns(module, cfg, sample, mesh, fns=None) -> adapters.ModelFns:
    """The model's functions (`fns` when LoRA made them) with qwix's quantised matmuls
    when model.quant is on. Raises ConfigError for a setting it does not compose with."""
    quant = cfg.model.quant
    if quant == "none":
        return fns if fns is not None else adapters.to_model_fns(module, mesh)
    for key, off, why in _REFUSED:
        if not off(cfg):
            raise ConfigError("model.quant", f"{quant} is not supported with {key} ({why}); "
                                             "turn one of them off")
    return adapters.to_model_fns(lora.wrap(module, provider(quant), sample, cfg.seed,
                                           "model.quant", f"model.quant={quant} quantises"),
                                 mesh)


def provider(quant: str):
    """qwix's QtProvider for `quant` ("int8" / "fp8"), one rule for every module; an
    operand is a weight when the trace leads back to the module's parameter
    (lora.module_weight: also under jax.grad, where qwix's own search matches shapes)."""
    import qwix

    def weight(x):
        return lora.module_weight(x)[0]

    class Provider(qwix.QtProvider):
        def dot_general(self, *args, **kwargs):
            with internals.qwix_weight_finder(weight):
                return super().dot_general(*args, **kwargs)

        def einsum(self, *args, **kwargs):
            with internals.qwix_weight_finder(weight):
                return super().einsum(*args, **kwargs)

        def conv_general_dilated(self, *args, **kwargs):
            with internals.qwix_weight_finder(weight):
                return super().conv_general_dilated(*args, **kwargs)

    internals.check_trace_walk()
    qtype, bwd = _QTYPES[quant]
    return Provider([qwix.QtRule(module_path=".*", weight_qtype=qtype, act_qtype=qtype,
                                 bwd_qtype=bwd)])


def check(quant: str, matmuls, name: str) -> None:
    """model.quant on a model of which qwix quantises none of the measured matmuls
    ((dtype name, count), ...): one line naming the model."""
    if quant != "none" and not any(n in precision.QUANTISED for n, _ in matmuls):
        raise ConfigError("model.quant", f"{quant}: qwix intercepts none of the matmuls "
                          f"of model {name} (it quantises jax.lax.dot_general, jnp.einsum "
                          "and convolutions inside Flax modules); set model.quant='none'")
