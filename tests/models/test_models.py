"""Tests for jtrain.models: shapes, precision, causality, sharding, dropout, learning, FLOPs."""

import jax

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from jtrain import mesh as jmesh
from jtrain import models
from jtrain.models import mlp as mlp_lib
from jtrain.models import transformer as tf_lib

SMALL = {"name": "transformer", "vocab_size": 32, "d_model": 16, "num_layers": 2,
         "num_heads": 2, "d_ff": 32, "max_len": 16, "dropout": 0.0, "tie_embeddings": True}
MLP_CFG = {"name": "mlp", "hidden": (16, 8), "num_outputs": 3, "dropout": 0.0,
           "activation": "gelu"}
ALLOWED_AXES = {name for name, _ in jmesh.LOGICAL_RULES}


def _tokens(batch=2, length=8, vocab=32, seed=0):
    return jax.random.randint(jax.random.key(seed), (batch, length), 0, vocab, jnp.int32)


def _build(cfg, dtype=jnp.float32, param_dtype=jnp.float32):
    return models.make_model(cfg, dtype=dtype, param_dtype=param_dtype)


def _init(model, x, seed=0):
    # One compiled init instead of hundreds of eager op dispatches: keeps the file fast.
    return jax.jit(model.init)(jax.random.key(seed), x)


def _dot_operand_dtypes(jaxpr):
    """Operand dtypes of every dot_general in a jaxpr, descending into sub-jaxprs."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(tuple(v.aval.dtype for v in eqn.invars))
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found.extend(_dot_operand_dtypes(inner))
    return found


@pytest.fixture(scope="module")
def small_params():
    """SMALL's initialised float32 params, compiled once: an init compile costs seconds here."""
    return _init(_build(SMALL), _tokens())


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tie", [True, False])
def test_transformer_shapes_and_param_dtypes(param_dtype, tie):
    model = _build({**SMALL, "tie_embeddings": tie}, param_dtype=param_dtype)
    tokens = _tokens()
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(param_dtype)}
    logits = jax.eval_shape(model.apply, params, tokens)
    assert logits.shape == (2, 8, 32) and logits.dtype == jnp.float32


@pytest.mark.slow  # seconds of CPU: the full suite runs it (tests/README.md)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_transformer_forward_is_finite(small_params, dtype):
    # Real numbers through the whole net, in full precision and all-bf16 (params too).
    params = jax.tree.map(lambda x: x.astype(dtype), small_params)
    model = _build(SMALL, dtype=dtype, param_dtype=dtype)
    logits = jax.jit(model.apply)(params, _tokens())
    assert logits.shape == (2, 8, 32) and logits.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(logits))) and np.asarray(logits).std() > 0


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
def test_mlp_shapes_and_param_dtypes(param_dtype):
    model = _build(MLP_CFG, param_dtype=param_dtype)
    x = jnp.ones((4, 2, 3), jnp.float32)  # flattened to [4, 6]
    params = _init(model, x)
    out = jax.jit(model.apply)(params, x)
    assert out.shape == (4, 3) and out.dtype == jnp.float32
    assert {leaf.dtype for leaf in jax.tree.leaves(nn.unbox(params))} == {jnp.dtype(param_dtype)}


def test_bf16_compute_runs_every_matmul_in_bf16():
    model = _build(SMALL, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    tokens = _tokens()
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)  # tracing needs no values
    dots = _dot_operand_dtypes(jax.make_jaxpr(model.apply)(params, tokens).jaxpr)
    # Per layer: q, k, v, scores, context, out, mlp in, mlp out; plus the logits.
    assert len(dots) == 8 * SMALL["num_layers"] + 1
    assert all(d == (jnp.bfloat16, jnp.bfloat16) for d in dots), dots
    assert jax.eval_shape(model.apply, params, tokens).dtype == jnp.float32

    mlp = _build(MLP_CFG, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    x = jnp.ones((4, 6))
    mparams = jax.eval_shape(mlp.init, jax.random.key(0), x)
    dots = _dot_operand_dtypes(jax.make_jaxpr(mlp.apply)(mparams, x).jaxpr)
    assert len(dots) == 3 and all(d == (jnp.bfloat16, jnp.bfloat16) for d in dots), dots


def test_float32_compute_runs_matmuls_in_float32():
    model = _build(SMALL)
    tokens = _tokens()
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)
    dots = _dot_operand_dtypes(jax.make_jaxpr(model.apply)(params, tokens).jaxpr)
    assert dots and all(d == (jnp.float32, jnp.float32) for d in dots)


def test_causal(small_params):
    model = _build(SMALL)
    tokens = _tokens(batch=1, length=10)
    params = small_params
    apply = jax.jit(model.apply)
    base = np.asarray(apply(params, tokens))
    t = 4
    changed = tokens.at[:, t + 1:].set((tokens[:, t + 1:] + 7) % 32)
    after = np.asarray(apply(params, changed))
    np.testing.assert_allclose(after[:, :t + 1], base[:, :t + 1], rtol=1e-5, atol=1e-5)
    assert not np.allclose(after[:, t + 1:], base[:, t + 1:])


def test_too_long_input_raises():
    model = _build(SMALL)
    with pytest.raises(ValueError, match="model.max_len"):
        _init(model, _tokens(length=SMALL["max_len"] + 1))


@pytest.mark.parametrize("cfg", [{**SMALL, "tie_embeddings": False}, MLP_CFG],
                         ids=["transformer", "mlp"])
def test_every_param_is_logically_partitioned(cfg):
    model = _build(cfg)
    x = _tokens() if cfg["name"] == "transformer" else jnp.ones((2, 6))
    abstract = jax.eval_shape(model.init, jax.random.key(0), x)
    leaves = jax.tree.leaves(abstract["params"],
                             is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert leaves
    for leaf in leaves:
        assert isinstance(leaf, nn.LogicallyPartitioned), leaf
        assert len(leaf.names) == leaf.value.ndim
        assert set(leaf.names) <= ALLOWED_AXES, leaf.names


@pytest.mark.multidevice
def test_params_shard_over_fsdp_on_fake_mesh():
    mesh = jmesh.make_mesh({"data": 2, "fsdp": 4, "tensor": 1})
    model = _build(SMALL)
    tokens = _tokens()

    def init(key, tokens):
        return nn.unbox(model.init(key, tokens))

    abstract = jax.eval_shape(model.init, jax.random.key(0), tokens)
    shardings = jmesh.logical_to_shardings(abstract, mesh)
    params = jax.jit(init, out_shardings=shardings)(jax.random.key(0), tokens)["params"]

    def is_sharded(arr):
        return arr.sharding.shard_shape(arr.shape) != arr.shape

    emb = params["embed"]["embedding"]  # [V, D]: D over fsdp
    assert emb.sharding.shard_shape(emb.shape) == (32, 16 // 4)
    layer = params["layer_0"]
    for arr in (layer["attn"]["query"], layer["attn"]["out"], layer["mlp"]["wi"],
                layer["mlp"]["wo"]):
        assert is_sharded(arr), arr.sharding
    assert not is_sharded(layer["attn_norm"]["scale"])  # norms are replicated
    assert np.all(np.isfinite(np.asarray(emb)))


@pytest.mark.parametrize("cfg", [{**SMALL, "dropout": 0.5}, {**MLP_CFG, "dropout": 0.5}],
                         ids=["transformer", "mlp"])
def test_dropout(cfg, request):
    model = _build(cfg)
    if cfg["name"] == "transformer":
        x, params = _tokens(), request.getfixturevalue("small_params")  # dropout adds no params
    else:
        x = jnp.ones((4, 6))
        params = _init(model, x)

    apply = jax.jit(model.apply, static_argnames="train")

    def run(train, seed):
        return np.asarray(apply(params, x, train=train, rngs={"dropout": jax.random.key(seed)}))

    assert not np.allclose(run(True, 1), run(True, 2))
    np.testing.assert_array_equal(run(True, 3), run(True, 3))
    # train=False needs no "dropout" rng (so it cannot depend on one) and equals the
    # dropout=0 model, which in turn needs no rng even with train=True.
    evaluated = np.asarray(apply(params, x))
    no_drop = _build({**cfg, "dropout": 0.0})
    no_drop_apply = jax.jit(no_drop.apply, static_argnames="train")
    np.testing.assert_array_equal(np.asarray(no_drop_apply(params, x, train=True)), evaluated)
    assert not np.allclose(run(True, 1), evaluated)


@pytest.mark.slow  # seconds of CPU: the full suite runs it (tests/README.md)
def test_transformer_overfits_repeating_bytes(small_params):
    model = _build(SMALL)
    # Bytes mod 32 to reuse SMALL's vocab of 32 (and its compiled init): the 9 distinct
    # bytes of the string stay distinct.
    data = np.frombuffer(b"hello world! " * 4, dtype=np.uint8).astype(np.int32) % 32
    assert len(set(data.tolist())) == 9
    windows = np.stack([data[i:i + 17] for i in range(13)])  # [13, 17]: every phase
    inputs, targets = jnp.asarray(windows[:, :-1]), jnp.asarray(windows[:, 1:])  # [13, 16]
    params = nn.unbox(small_params)
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)

    def loss_fn(p):
        logits = model.apply(p, inputs, train=True)  # [13, 16, 32]
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    @jax.jit
    def step(p, s):
        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    first = None
    for i in range(100):
        params, opt_state, loss = step(params, opt_state)
        if i == 0:
            first = float(loss)
        if i % 10 == 9:
            loss.block_until_ready()
    assert first > 2.5  # starts near ln(32) = 3.5
    assert float(loss) < 0.5, float(loss)


def test_transformer_flops_match_formula():
    cfg = {**SMALL, "tie_embeddings": False}
    L, D, F, V, T = 2, 16, 32, 32, 8
    n = L * (4 * D * D + 2 * D * F) + D * V
    expected = (6 * n + 12 * L * D * T) * T
    assert models.flops_per_example(cfg, (T,)) == pytest.approx(expected)
    assert models.flops_per_example(SMALL, (T,)) == pytest.approx(expected)  # tied: same work
    assert models.flops_per_example(SMALL, (T,)) > 0

    # N is the real parameter count, less norm scales and (when untied) the lookup table.
    params = nn.unbox(jax.eval_shape(_build(cfg).init, jax.random.key(0), _tokens()))["params"]
    total = sum(x.size for x in jax.tree.leaves(params))
    norms = (2 * L + 1) * D
    assert tf_lib.matmul_params(cfg) == total - norms - V * D
    tied = nn.unbox(jax.eval_shape(_build(SMALL).init, jax.random.key(0), _tokens()))["params"]
    assert tf_lib.matmul_params(SMALL) == sum(x.size for x in jax.tree.leaves(tied)) - norms


def test_mlp_flops_are_six_times_params():
    params = nn.unbox(jax.eval_shape(_build(MLP_CFG).init, jax.random.key(0), jnp.ones((1, 2, 3))))
    count = sum(x.size for x in jax.tree.leaves(params))
    assert count == (6 * 16 + 16) + (16 * 8 + 8) + (8 * 3 + 3)
    assert models.flops_per_example(MLP_CFG, (2, 3)) == 6 * count
    assert mlp_lib.num_params(MLP_CFG, (2, 3)) == count


def test_unknown_model_name():
    msg = "model.name: unknown model 'x'; choose one of: mlp, transformer, user"
    with pytest.raises(ValueError) as e:
        models.make_model({"name": "x"}, dtype=jnp.float32, param_dtype=jnp.float32)
    assert str(e.value) == msg
    with pytest.raises(ValueError, match="model.name"):
        models.flops_per_example({"name": "x"}, (8,))


@pytest.mark.parametrize("override, match", [
    ({"name": "transformer", "num_heads": 3},
     "model.num_heads: d_model=128 is not divisible by num_heads=3"),
    ({"name": "transformer", "d_model": 0}, "model.d_model"),
    ({"name": "transformer", "dropout": 1.5}, "model.dropout"),
    ({"name": "transformer", "vocab_size": 2.5}, "model.vocab_size"),
    ({"name": "transformer", "tie_embeddings": "yes"}, "model.tie_embeddings"),
    ({"name": "mlp", "hidden": (64, -1)}, "model.hidden"),
    ({"name": "mlp", "activation": "swish9"}, "model.activation: unknown activation 'swish9'"),
    ({"name": "mlp", "num_outputs": 0}, "model.num_outputs"),
])
def test_build_rejects_nonsense(override, match):
    with pytest.raises(ValueError, match=match):
        models.make_model(override, dtype=jnp.float32, param_dtype=jnp.float32)


def test_make_model_takes_a_config_dict():
    import ml_collections

    from jtrain import config as config_lib

    cfg = ml_collections.ConfigDict({**config_lib.defaults("mlp").model.to_dict(),
                                     "num_outputs": 2})
    model = models.make_model(cfg, dtype=jnp.float32, param_dtype=jnp.float32)
    assert model.num_outputs == 2 and model.hidden == (64, 64)


@pytest.mark.multidevice
def test_nnx_factory_with_partitioned_params_trains_sharded(tmp_path):
    """An NNX factory (rngs -> Module) whose kernels carry nnx.with_partitioning is split
    once, shapes-first, under the run's mesh; its kernels come out sharded over fsdp."""
    import numpy as np
    from flax import nnx

    import jtrain

    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            # Mesh axis names: NNX shards eagerly at creation, where logical names
            # ("embed") do not resolve yet.
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("fsdp", None))
            self.hidden = nnx.Linear(8, 16, kernel_init=init, rngs=rngs)
            self.out = nnx.Linear(16, 2, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.hidden(x)))

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    result = jtrain.train({"total_steps": 30, "data": {"batch_size": 32},
                           "mesh": {"data": -1, "fsdp": 2}, "optim": {"lr": 1e-2},
                           "eval": {"every_steps": 0}, "log": {"every_steps": 10}},
                          str(tmp_path / "run"), model=lambda rngs: Net(rngs),
                          train_data=(x[:224], y[:224]), eval_data=(x[224:], y[224:]))
    kernel = result.state.params["hidden"]["kernel"]
    assert kernel.shape == (8, 16)
    assert "fsdp" in str(kernel.sharding.spec)
    assert result.summary["eval/accuracy"] > 0.8
