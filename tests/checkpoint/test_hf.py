"""Hugging Face in and out: the layout mapping (bitwise both ways), config checks naming
the field, `--format=hf` logits equal to transformers', `init.path=hf:DIR` into
the built-in transformer and (with init.map) into another model, and an FSDP
run on 8 devices importing and exporting the same bytes. Tiny random configs, offline."""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtrain import config as config_lib
from jtrain.checkpoint import export, hf, hf_export
from jtrain.checkpoint.integrity import leaf_path
from jtrain.errors import ConfigError, ExportError, RestoreError
from jtrain.models.transformer import Transformer
from test_checkpoint import abstract, make_config, make_state, open_run as _open_run


def open_run(workdir, cfg=None, state=None, init_fn=None):
    if init_fn is None:
        return _open_run(workdir, cfg, state)
    from jtrain import checkpoint

    ck = checkpoint.Checkpointer(str(workdir), cfg, {"name": "unit"})
    return ck, ck.restore_or_init(abstract(state), init_fn)

DIMS = dict(vocab_size=256, d_model=32, num_layers=2, num_heads=4, d_ff=48, max_len=64)
TOKENS = np.random.RandomState(0).randint(0, 256, (2, 17))


def builtin(mlp="swiglu", tie=True, seed=0, **over):
    """(module, {path: numpy}) of a tiny built-in transformer: random params of its
    shapes (eval_shape: no eager init)."""
    m = Transformer(**{**DIMS, **over}, dropout=0.0, tie_embeddings=tie, mlp=mlp)
    shapes = jax.eval_shape(m.init, jax.random.PRNGKey(0), TOKENS)["params"]
    shapes = jax.tree.map(lambda x: getattr(x, "value", x), shapes,
                          is_leaf=lambda x: hasattr(x, "value"))
    rng = np.random.RandomState(seed)
    return m, {leaf_path(p): (rng.standard_normal(v.shape) * 0.2).astype(np.float32)
               for p, v in jax.tree_util.tree_flatten_with_path(shapes)[0]}


def logits_of(m, params):
    return np.asarray(jax.jit(m.apply)({"params": params}, TOKENS))


def nested(leaves):
    out = {}
    for path, v in leaves.items():
        *parents, last = path.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = jnp.asarray(v)
    return out


@pytest.mark.parametrize("mlp,tie", [("swiglu", True), ("gelu", False)])
def test_mapping_is_bitwise_both_ways(mlp, tie):
    _, leaves = builtin(mlp, tie)
    tensors = hf.to_hf(leaves)
    q = tensors["model.layers.1.self_attn.q_proj.weight"]
    assert q.shape == (32, 32) and np.array_equal(q, leaves["layer_1/attn/query"].reshape(32, 32).T)
    assert tensors["model.layers.0.mlp.up_proj.weight"].shape == (48, 32)
    assert ("model.layers.0.mlp.gate_proj.weight" in tensors) == (mlp == "swiglu")
    assert ("lm_head.weight" in tensors) == (not tie)
    back = hf.from_hf(tensors, leaves, "x")
    assert sorted(back) == sorted(f"params/{k}" for k in leaves)
    for k, v in leaves.items():
        assert back[f"params/{k}"].dtype == v.dtype and np.array_equal(back[f"params/{k}"], v)


def llama_config(**over):
    return {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4,
            "num_key_value_heads": 4, "hidden_act": "silu", "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "tie_word_embeddings": True, **over}


@pytest.mark.parametrize("field,value", [
    ("model_type", "gpt2"), ("num_key_value_heads", 2), ("attention_bias", True),
    ("hidden_act", "gelu"), ("rms_norm_eps", 1e-5), ("tie_word_embeddings", False),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 500000.0}),
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
])
def test_config_the_builtin_model_cannot_represent_names_the_field(field, value):
    _, leaves = builtin("swiglu", tie=True)
    hf.check_config(llama_config(), "hf:d", leaves)  # the representable one passes
    with pytest.raises(ExportError, match=f"^hf:d: config.json {field}="):
        hf.check_config(llama_config(**{field: value}), "hf:d", leaves)
    _, gelu = builtin("gelu")
    with pytest.raises(ExportError, match="model_type='llama'.*model.mlp=swiglu"):
        hf.check_config(llama_config(), "hf:d", gelu)


def test_init_map_config_and_rename():
    cfg = config_lib.resolve({"model": {"name": "mlp"}, "init": {"map": {
        r"^proj\.weight$": "dense/kernel.T"}}})
    assert [tuple(p) for p in cfg.init.map] == [(r"^proj\.weight$", "dense/kernel.T")]
    for bad in ("x", [("a",)], [("(", "b")]):
        with pytest.raises(ConfigError, match="init.map"):
            config_lib.resolve({"init": {"map": bad}})
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = hf.rename({"proj.weight": w, "other": w}, hf.parse_map([(r"^proj\.weight$",
                                                                   "dense/kernel.T")]))
    assert np.array_equal(out["params/dense/kernel"], w.T) and "other" in out
    with pytest.raises(ExportError, match="a and b both map to x$"):
        hf.rename({"a": w, "b": w}, hf.parse_map([("^.$", "x")]))


@pytest.fixture(scope="module")
def tf():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers, torch


def hf_logits(tf, directory):
    transformers, torch = tf
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.numpy()


@pytest.mark.parametrize("mlp,tie", [("swiglu", False), ("gelu", True)])
def test_export_loads_in_transformers_with_equal_logits(tf, tmp_path, mlp, tie):
    m, leaves = builtin(mlp, tie)
    ours = logits_of(m, nested(leaves))
    info = hf_export.write(str(tmp_path), leaves, {"model": {"name": "transformer",
                                                             "max_len": 64}})
    assert info["architecture"] == hf.ARCHITECTURES[mlp][0] and info["tokenizer"] == "bytes"
    np.testing.assert_allclose(hf_logits(tf, tmp_path), ours, atol=1e-4, rtol=0)
    if mlp == "gelu":  # the byte tokenizer: ids are the UTF-8 bytes, and back
        tok = tf[0].AutoTokenizer.from_pretrained(str(tmp_path))
        text = "héllo wörld\n\t  €x"
        ids = tok(text)["input_ids"]
        assert ids == list(text.encode()) and tok.decode(ids) == text


def start_from(workdir, source, leaves):
    """The Start of a run of the built-in model with `leaves`' shapes, path=source."""
    fresh = make_state().replace(params=nested(leaves), opt_state=())
    return open_run(workdir, make_config(path=source), fresh, lambda: fresh)


def test_hf_llama_into_the_builtin_model(tf, tmp_path, capfd):
    transformers, torch = tf
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-6,
        tie_word_embeddings=False, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(tmp_path / "llama"))
    want = hf_logits(tf, tmp_path / "llama")
    m, leaves = builtin("swiglu", tie=False, seed=1)
    ck, start = start_from(tmp_path / "run", f"hf:{tmp_path}/llama", leaves)
    ck.close()
    got = logits_of(m, start.state.params)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert "initialized from hf:" in capfd.readouterr().err
    # HF -> jtrain -> HF: every tensor bitwise
    params = {leaf_path(p): np.asarray(v)
              for p, v in jax.tree_util.tree_flatten_with_path(start.state.params)[0]}
    saved, _ = export.read_safetensors(str(tmp_path / "llama" / "model.safetensors"))
    again = hf.to_hf(params)
    assert sorted(again) == sorted(saved)
    assert all(np.array_equal(again[k], saved[k]) for k in saved)
    # a model with another d_ff: the leaf and both shapes; another MLP: the field
    _, wide = builtin("swiglu", tie=False, d_ff=64)
    with pytest.raises(RestoreError, match=r"up_proj.weight \(48, 32\) does not fit "
                                           r"layer_0/mlp/wi \(32, 64\)"):
        start_from(tmp_path / "r2", f"hf:{tmp_path}/llama", wide)
    _, gelu = builtin("gelu", tie=False)
    with pytest.raises(RestoreError, match="config.json model_type='llama'"):
        start_from(tmp_path / "r3", f"hf:{tmp_path}/llama", gelu)


def test_hf_into_a_user_model_by_init_map(tmp_path, capfd):
    hf_dir = tmp_path / "user"
    os.makedirs(hf_dir)
    json.dump({"model_type": "whatever"}, open(hf_dir / "config.json", "w"))
    w = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)  # torch Linear [out, in]
    export.write_safetensors(str(hf_dir / "model.safetensors"),
                             {"proj.weight": w, "proj.bias": np.ones(16, np.float32),
                              "extra": np.zeros(2, np.float32)}, {"format": "pt"})
    with pytest.raises(ConfigError, match="init.map: required"):
        open_run(tmp_path / "a", make_config(path=f"hf:{hf_dir}"))
    pairs = [(r"^proj\.weight$", "dense/kernel.T"), (r"^proj\.(bias)$", r"dense/\1")]
    ck, start = open_run(tmp_path / "b", make_config(path=f"hf:{hf_dir}", map=pairs))
    ck.close()
    np.testing.assert_array_equal(start.state.params["dense"]["kernel"], w.T)
    np.testing.assert_array_equal(start.state.params["dense"]["bias"], np.ones(16))
    assert "2 leaves (params), 1 source leaves unused (extra)" in capfd.readouterr().err


FSDP_CONFIG = dict(seed=0, total_steps=1, model=dict(name="transformer", **DIMS, mlp="swiglu"),
                   data=dict(name="pystdlib", seq_len=16, batch_size=8),
                   optim=dict(lr=0.0), mesh=dict(fsdp=8), eval=dict(num_batches=1),
                   checkpoint=dict(every_steps=1, async_save=False))


@pytest.mark.multidevice
def test_fsdp_run_imports_and_exports_the_same_bytes(tmp_path):
    """An FSDP run (8 devices) started from an export (lr 0: the params stay) exports
    byte-identical weights: import and export ignore how the params are sharded."""
    import jtrain
    from jtrain import export as export_command

    assert len(jax.devices()) == 8
    _, leaves = builtin("swiglu", tie=True, seed=3)
    src = tmp_path / "src"
    os.makedirs(src)
    export.write_safetensors(str(src / "model.safetensors"), hf.to_hf(leaves), {"format": "pt"})
    json.dump(llama_config(), open(src / "config.json", "w"))
    cfg = {**FSDP_CONFIG, "init": {"path": f"hf:{src}"}}
    result = jtrain.train(cfg, str(tmp_path / "run"))
    kernel = result.state.params["layer_0"]["attn"]["query"]
    assert len(kernel.sharding.device_set) == 8
    out = tmp_path / "out"  # the weights file --format=hf writes, without transformers
    assert export_command.main([str(tmp_path / "run"), f"--out={out}"]) == 0
    saved, _ = export.read_safetensors(str(out / export.PARAMS_FILE))
    export.write_safetensors(str(out / "model.safetensors"), hf.to_hf(saved), {"format": "pt"})
    assert (open(out / "model.safetensors", "rb").read()
            == open(src / "model.safetensors", "rb").read())


def test_format_hf_without_transformers_is_one_line(tmp_path, monkeypatch, capsys):
    from jtrain import export as export_command

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    assert export_command.main([str(tmp_path), f"--out={tmp_path / 'o'}", "--format=hf"]) == 3
    assert capsys.readouterr().err.strip() == ("jtrain: export error: --format=hf needs "
                                               "transformers: pip install 'jtrain[hf]'")
