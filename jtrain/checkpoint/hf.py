"""The built-in transformer's parameters in Hugging Face's layout and back (numpy only).

jtrain's decoder (jtrain/models/transformer.py) is the Llama block with one choice left
open, its MLP (`model.mlp`):

    model.mlp = "swiglu"  ->  LlamaForCausalLM  (down(silu(gate(x)) * up(x)), hidden_act silu)
    model.mlp = "gelu"    ->  ArceeForCausalLM  (down(act(up(x))), hidden_act
                              gelu_pytorch_tanh: flax's GELU is the tanh approximation)

Both share what the rest of the block is: pre-norm RMSNorm (eps 1e-6, a scale and no
bias), rotary positions on the query and key with the half-split convention (HF's
`rotate_half`, theta 10000, head_dim = d_model / num_heads), one key/value head per query
head, softmax scaled by head_dim ** -0.5, no biases anywhere, an unscaled embedding and
`tie_word_embeddings` = model.tie_embeddings.

Tensors (D = d_model, H = heads, Dh = D / H, F = d_ff, V = vocab; HF's nn.Linear
stores [out, in], jtrain [in, out] with the heads split out):

    embed/embedding        [V, D]      model.embed_tokens.weight     [V, D]
    layer_i/attn_norm/scale [D]        model.layers.i.input_layernorm.weight
    layer_i/attn/query     [D, H, Dh]  model.layers.i.self_attn.q_proj.weight [H*Dh, D]
    layer_i/attn/key, value            ...k_proj.weight, ...v_proj.weight (same)
    layer_i/attn/out       [H, Dh, D]  model.layers.i.self_attn.o_proj.weight [D, H*Dh]
    layer_i/mlp_norm/scale [D]         model.layers.i.post_attention_layernorm.weight
    layer_i/mlp/wi         [D, F]      model.layers.i.mlp.up_proj.weight   [F, D]
    layer_i/mlp/wi_gate    [D, F]      model.layers.i.mlp.gate_proj.weight [F, D] (swiglu)
    layer_i/mlp/wo         [F, D]      model.layers.i.mlp.down_proj.weight [D, F]
    final_norm/scale       [D]         model.norm.weight
    logits                 [D, V]      lm_head.weight [V, D] (untied only)

Every step is a transpose or a reshape: the round trip is bitwise.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

from jtrain.checkpoint import export as export_lib
from jtrain.checkpoint import tensorfile
from jtrain.errors import ExportError, first_line

HF_PREFIX = "hf:"
NORM_EPS = 1e-6  # flax.linen.RMSNorm's default, what the built-in model uses
ROPE_THETA = 10_000.0
# model.mlp -> (HF architecture, model_type, hidden_act)
ARCHITECTURES = {"swiglu": ("LlamaForCausalLM", "llama", "silu"),
                 "gelu": ("ArceeForCausalLM", "arcee", "gelu_pytorch_tanh")}
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")  # the same function in HF


def layout(leaves: dict) -> dict | None:
    """The built-in transformer's dimensions from its parameter names and shapes
    ({path: array or shape}, paths without "params/"), or None if not its layout."""
    shape = {k: tuple(getattr(v, "shape", v)) for k, v in leaves.items()}
    if "embed/embedding" not in shape or "layer_0/attn/query" not in shape:
        return None
    layers = 0
    while f"layer_{layers}/attn/query" in shape:
        layers += 1
    v, d = shape["embed/embedding"]
    _, h, dh = shape["layer_0/attn/query"]
    return {"vocab_size": v, "d_model": d, "num_heads": h, "head_dim": dh,
            "num_layers": layers, "d_ff": shape["layer_0/mlp/wi"][1],
            "mlp": "swiglu" if "layer_0/mlp/wi_gate" in shape else "gelu",
            "tie_embeddings": "logits" not in shape}


def _pairs(layers: int, mlp: str):
    """(jtrain path, HF name, kind) of every tensor; kind says how the layout differs."""
    out = [("embed/embedding", "model.embed_tokens.weight", "same")]
    for i in range(layers):
        j, h = f"layer_{i}/", f"model.layers.{i}."
        out += [(j + "attn_norm/scale", h + "input_layernorm.weight", "same"),
                (j + "attn/query", h + "self_attn.q_proj.weight", "in_heads"),
                (j + "attn/key", h + "self_attn.k_proj.weight", "in_heads"),
                (j + "attn/value", h + "self_attn.v_proj.weight", "in_heads"),
                (j + "attn/out", h + "self_attn.o_proj.weight", "heads_out"),
                (j + "mlp_norm/scale", h + "post_attention_layernorm.weight", "same"),
                (j + "mlp/wi", h + "mlp.up_proj.weight", "linear"),
                (j + "mlp/wo", h + "mlp.down_proj.weight", "linear")]
        if mlp == "swiglu":
            out.append((j + "mlp/wi_gate", h + "mlp.gate_proj.weight", "linear"))
    out += [("final_norm/scale", "model.norm.weight", "same"),
            ("logits", "lm_head.weight", "linear")]
    return out


def to_hf(leaves: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """jtrain parameter paths (no "params/") -> HF tensor names, HF layouts."""
    dims = layout(leaves)
    if dims is None:
        raise ExportError("--format=hf: the parameters are not the built-in transformer's "
                          "(model.name=transformer)")
    out = {}
    for path, name, kind in _pairs(dims["num_layers"], dims["mlp"]):
        if path not in leaves:
            continue  # logits of a tied model
        a = leaves[path]
        if kind == "in_heads":  # [D, H, Dh] -> [H*Dh, D]
            a = a.reshape(a.shape[0], -1).T
        elif kind == "heads_out":  # [H, Dh, D] -> [D, H*Dh]
            a = a.reshape(-1, a.shape[-1]).T
        elif kind == "linear":  # [in, out] -> [out, in]
            a = a.T
        out[name] = np.ascontiguousarray(a)
    unknown = sorted(set(leaves) - {p for p, _, _ in _pairs(dims["num_layers"], dims["mlp"])})
    if unknown:
        raise ExportError(f"--format=hf: {unknown[0]} has no place in the Hugging Face "
                          "layout (a LoRA run exports with --merge_lora)")
    return out


def from_hf(tensors: dict[str, np.ndarray], target: dict, where: str, skip=()
            ) -> dict[str, np.ndarray]:
    """HF tensors -> {"params/<path>": array} for the built-in layout `target` ({path
    without "params/": shape}; paths in `skip` are left out, unchecked); a shape that does not fit
    is an ExportError naming both tensors and shapes. HF tensors it has no place for keep their HF
    names (the report lists them unused)."""
    dims = layout(target)
    out, used = {}, set()
    for path, name, kind in _pairs(dims["num_layers"], dims["mlp"]):
        if name not in tensors or path not in target:
            continue
        used.add(name)
        if path in skip:
            continue
        a, want = tensors[name], tuple(getattr(target[path], "shape", target[path]))
        if kind in ("in_heads", "heads_out", "linear") and a.ndim == 2:
            a = a.T  # [out, in] -> [in, out]
        if a.size == int(np.prod(want)) and a.ndim == 2 and len(want) == 3 and (
                a.shape == (want[0], want[1] * want[2])
                or a.shape == (want[0] * want[1], want[2])):
            a = a.reshape(want)  # the heads split out
        if tuple(a.shape) != want:
            raise ExportError(f"{where}: {name} {tuple(tensors[name].shape)} does not fit "
                              f"{path} {want} (init.exclude keeps a "
                              "leaf's fresh init)")
        out[f"params/{path}"] = np.ascontiguousarray(a)
    if dims["tie_embeddings"]:
        used.add("lm_head.weight")  # a tied checkpoint may store it: the embedding again
    out.update({name: a for name, a in tensors.items() if name not in used})
    return out


# The config.json fields check_config reads: (field, types, what the one line says).
_FIELD_TYPES = (("model_type", str, "a string"), ("hidden_act", str, "a string"),
                ("num_attention_heads", int, "an integer"),
                ("num_key_value_heads", int, "an integer"),
                ("hidden_size", int, "an integer"), ("head_dim", int, "an integer"),
                ("attention_bias", bool, "true or false"), ("mlp_bias", bool, "true or false"),
                ("tie_word_embeddings", bool, "true or false"),
                ("rms_norm_eps", (int, float), "a number"),
                ("rope_theta", (int, float), "a number"),
                ("rope_parameters", dict, "an object"), ("rope_scaling", dict, "an object"))


def check_config(hf: dict, where: str, target: dict) -> None:
    """ExportError naming the first field of an HF config.json that the built-in model
    (its layout `target`) cannot represent."""
    dims = layout(target)

    def bad(field, why):
        raise ExportError(f"{where}: config.json {field}={hf.get(field)!r}: {why}")

    for field, kinds, what in _FIELD_TYPES:
        value = hf.get(field)
        if value is not None and (not isinstance(value, kinds) or (
                isinstance(value, bool) and kinds is not bool)):
            bad(field, f"expected {what}")
    rope_cfg = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope_cfg.get("rope_theta", 0.0), (int, float)) or isinstance(
            rope_cfg.get("rope_theta"), bool):
        bad("rope_parameters", "rope_theta: expected a number")

    model_type = hf.get("model_type")
    if model_type not in ("llama", "arcee"):
        bad("model_type", "the built-in transformer loads llama (model.mlp=swiglu) or "
            "arcee (model.mlp=gelu) checkpoints; load others into your own model with "
            "init.map")
    heads = hf.get("num_attention_heads")
    if hf.get("num_key_value_heads", heads) != heads:
        bad("num_key_value_heads", f"grouped key/value heads (num_attention_heads={heads}) "
            "are not implemented in the built-in transformer")
    if hf.get("head_dim") not in (None, hf.get("hidden_size", 0) // max(heads or 1, 1)):
        bad("head_dim", "the built-in transformer has head_dim = hidden_size / "
            "num_attention_heads")
    for field in ("attention_bias", "mlp_bias"):
        if hf.get(field):
            bad(field, "the built-in transformer has no biases")
    act = hf.get("hidden_act")
    if model_type == "llama" and act != "silu":
        bad("hidden_act", "the built-in swiglu MLP is silu-gated")
    if model_type == "arcee" and act not in _GELU_TANH:
        bad("hidden_act", "the built-in gelu MLP is GELU (tanh approximation)")
    mlp = "swiglu" if model_type == "llama" else "gelu"
    if dims["mlp"] != mlp:
        bad("model_type", f"its MLP is the built-in model.mlp={mlp}; the model here has "
            f"model.mlp={dims['mlp']}")
    if abs(float(hf.get("rms_norm_eps", NORM_EPS)) - NORM_EPS) > 1e-12:
        bad("rms_norm_eps", f"the built-in transformer's RMSNorm epsilon is {NORM_EPS:g}")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", ROPE_THETA))
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        bad("rope_parameters", "scaled rotary positions are not implemented in the "
            "built-in transformer")
    if float(theta) != ROPE_THETA:
        bad("rope_parameters", f"rope_theta={theta}: the built-in transformer's is "
            f"{ROPE_THETA:g}")
    tied = bool(hf.get("tie_word_embeddings", False))
    if tied != dims["tie_embeddings"]:
        bad("tie_word_embeddings", f"set model.tie_embeddings={tied}")


def read_dir(directory: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json, tensors) of a local Hugging Face checkpoint: model.safetensors or
    the shards its model.safetensors.index.json lists, each tensor read from the shard
    the index names. Shards are plain file names inside `directory` and regular files."""
    config_file = os.path.join(directory, "config.json")
    if not os.path.lexists(config_file):
        raise ExportError(f"{directory}: no config.json (a Hugging Face model directory, "
                          "as save_pretrained writes it)")
    config = _read_json(config_file)
    single = os.path.join(directory, "model.safetensors")
    index = single + ".index.json"
    if os.path.lexists(single):
        return config, export_lib.read_safetensors(single)[0]
    if not os.path.lexists(index):
        raise ExportError(f"{directory}: no model.safetensors (PyTorch .bin checkpoints "
                          "are not read: re-save with save_pretrained(safe_serialization="
                          "True))")
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ExportError(index, "weight_map: missing or not an object of tensor name -> "
                          "shard file")
    shards: dict[str, dict] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or shard in ("", ".", "..") or "/" in shard or (
                "\\" in shard or "\0" in shard):
            raise ExportError(index, f"weight_map: {name!r} -> {shard!r}: a shard is a "
                              "plain file name in the checkpoint's directory")
        if shard not in shards:
            shards[shard] = export_lib.read_safetensors(os.path.join(directory, shard))[0]
    tensors = {}
    for name, shard in weight_map.items():
        if name not in shards[shard]:
            raise ExportError(index, f"weight_map: {name!r} -> {shard!r}: that shard has "
                              "no such tensor")
        tensors[name] = shards[shard][name]
    return config, tensors


_JSON_CAP = 100_000_000


def _read_json(path: str) -> dict:
    """A JSON object from a regular file (at most _JSON_CAP bytes), else one ExportError
    naming the file."""
    with tensorfile.open_regular(path) as f:
        raw = f.read(_JSON_CAP + 1)
    if len(raw) > _JSON_CAP:
        raise ExportError(path, f"over {_JSON_CAP} bytes")
    try:
        value = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise ExportError(path, f"not JSON ({first_line(e)[:100]})") from None
    if not isinstance(value, dict):
        raise ExportError(path, "expected a JSON object")
    return value


def parse_map(init_map, compiled: bool = True) -> list[tuple]:
    """init.map (a dict {regex: replacement} or a list of pairs) -> pairs, the
    regexes compiled unless `compiled` is False."""
    items = init_map.items() if isinstance(init_map, dict) else init_map
    return [(re.compile(pattern) if compiled else pattern, replacement)
            for pattern, replacement in items]


_PARAMS = "params/"
_STATE = ("opt_state/", "ema/")  # a run's other leaves that belong to parameters


def source_params(loaded: dict) -> list[str]:
    """The names init_map's regexes see: a run's or an export's parameter paths (without
    "params/"), or a Hugging Face checkpoint's tensor names."""
    return sorted(k[len(_PARAMS):] if k.startswith(_PARAMS) else k
                  for k in loaded if not k.startswith(_STATE))


def _parameter(key: str, names: set) -> tuple[str, str | None]:
    """(state prefix, parameter name) of a source leaf: ("params/", "o/kernel"),
    ("opt_state/.../mu/", "o/kernel"), ("", "proj.weight") for a Hugging Face tensor;
    (key, None) for a leaf of no parameter."""
    if key.startswith(_PARAMS):
        return _PARAMS, key[len(_PARAMS):]
    if not key.startswith(_STATE):
        return "", key
    parts = key.split("/")
    for i in range(1, len(parts)):
        if (tail := "/".join(parts[i:])) in names:
            return "/".join(parts[:i]) + "/", tail
    return key, None


def rename(loaded: dict[str, np.ndarray], pairs) -> dict[str, np.ndarray]:
    """Source leaves renamed parameter by parameter: the first pair whose regex matches
    a parameter's name (`source_params`) rewrites it (re.sub, once) into the model's
    parameter path (a leading "params/" is dropped); a replacement ending in `.T` also
    transposes (torch Linear [out, in] -> flax kernel [in, out]). A run's optimizer state
    and average of that parameter follow it. Names that no pair matches are kept."""
    names = set(source_params(loaded))
    new_names = {}
    for name in names:
        for rx, replacement in pairs:
            if rx.search(name):
                new = rx.sub(replacement, name, count=1)
                new = new[len(_PARAMS):] if new.startswith(_PARAMS) else new
                new_names[name] = (new[:-2], True) if new.endswith(".T") else (new, False)
                break
    out, origin = {}, {}
    for key, arr in loaded.items():
        head, name = _parameter(key, names)
        new_key = key
        if name in new_names:
            new, transpose = new_names[name]
            new_key = (head or _PARAMS) + new
            arr = np.ascontiguousarray(arr.T) if transpose else arr
        if new_key in out:
            raise ExportError(f"init.map: {_shown(origin[new_key])} and "
                              f"{_shown(key)} both map to {_shown(new_key)}")
        out[new_key], origin[new_key] = arr, key
    return out


def _shown(key: str) -> str:
    return key[len(_PARAMS):] if key.startswith(_PARAMS) else key
