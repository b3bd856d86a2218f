"""`jtrain export --format=hf`: a directory that `transformers` loads with
`AutoModelForCausalLM.from_pretrained(DIR)`: config.json (LlamaForCausalLM for
model.mlp=swiglu, ArceeForCausalLM for model.mlp=gelu; jtrain.checkpoint.hf has the
mapping), model.safetensors, and the tokenizer: the run's tokenizer.json (a run on token
shards keeps a copy in its workdir) or, for a byte model (vocab_size 256), a byte-level
tokenizer whose token ids are the bytes themselves, so `AutoTokenizer.from_pretrained(DIR)`
encodes text as the model was trained on it.

transformers is needed (the `hf` extra) and imported only here, when the export is asked.
"""

from __future__ import annotations

import functools
import os
import shutil

import numpy as np

from jtrain.checkpoint import export as export_lib
from jtrain.checkpoint import hf
from jtrain.errors import ConfigError, ExportError

WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")  # a run's copy (data.name=tokens)
_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ExportError("--format=hf needs transformers: pip install 'jtrain[hf]'") from None
    return transformers


def hf_config(model_cfg: dict, dims: dict, dtype: str):
    """The transformers config object of the built-in transformer's `model` section."""
    transformers = _transformers()
    arch, _, act = hf.ARCHITECTURES[dims["mlp"]]
    cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    return cls(vocab_size=dims["vocab_size"], hidden_size=dims["d_model"],
               intermediate_size=dims["d_ff"], num_hidden_layers=dims["num_layers"],
               num_attention_heads=dims["num_heads"], num_key_value_heads=dims["num_heads"],
               head_dim=dims["head_dim"], hidden_act=act,
               max_position_embeddings=int(model_cfg.get("max_len", 256)),
               rms_norm_eps=hf.NORM_EPS,
               rope_parameters={"rope_type": "default", "rope_theta": hf.ROPE_THETA},
               attention_bias=False, mlp_bias=False, attention_dropout=0.0,
               tie_word_embeddings=dims["tie_embeddings"], bos_token_id=None,
               eos_token_id=None, pad_token_id=None, architectures=[arch], dtype=dtype)


def export(workdir: str, out: str, **kwargs) -> dict:
    """jtrain.checkpoint.export.export (same arguments) writing a Hugging Face directory;
    the record's "hf" entry says the architecture and the tokenizer."""
    _transformers()  # before anything is read: the one-line install hint
    tokenizer = next((p for p in (os.path.join(workdir, n) for n in TOKENIZER_FILES)
                      if os.path.isfile(p)), None)
    return export_lib.export(workdir, out, writer=functools.partial(
        write, tokenizer=tokenizer), check=exportable, **kwargs)


def exportable(config: dict) -> None:
    """One line for a run the Hugging Face export cannot map (before anything is
    written): a model other than the built-in transformer, its mixture of experts, or
    its blocks stacked into pipeline stages."""
    model_cfg = config.get("model") or {}
    if model_cfg.get("name", "transformer") != "transformer":
        raise ExportError(f"--format=hf: model.name={model_cfg.get('name')}: the Hugging "
                          "Face export maps the built-in transformer (model.name="
                          "transformer); export your own model with the default format")
    experts = (model_cfg.get("moe") or {}).get("experts", 0)
    if experts:
        raise ConfigError("model.moe.experts", f"{experts}: a mixture-of-experts model is "
                          "not exportable to Hugging Face (export it with the default format)")
    stages = (config.get("mesh") or {}).get("stage", 1)
    if stages > 1:
        raise ConfigError("mesh.stage", f"{stages}: a run with pipeline stages holds its "
                          "blocks stacked per stage; the Hugging Face export maps the plain "
                          "layer stack (export it with the default format)")


def write(out: str, leaves: dict[str, np.ndarray], config: dict,
          tokenizer: str | None = None) -> dict:
    """Writes the HF directory `out` from the parameter leaves (paths without "params/")
    and the run's config; returns {"architecture", "tokenizer"} for the record.
    `tokenizer`: the run's copy of its tokenizer (data.name=tokens), carried instead of
    the byte tokenizer."""
    exportable(config)
    model_cfg = config.get("model") or {}
    dims = hf.layout(leaves)
    if dims is None:
        raise ExportError("--format=hf: the parameters are not the built-in transformer's")
    tensors = hf.to_hf(leaves)
    dtypes = {a.dtype.name for a in tensors.values()}
    dtype = _DTYPE_NAMES.get(dtypes.pop() if len(dtypes) == 1 else "float32", "float32")
    cfg = hf_config(model_cfg, dims, dtype)
    os.makedirs(out, exist_ok=True)
    cfg.save_pretrained(out)
    # transformers reads safetensors whose metadata says format "pt".
    export_lib.write_safetensors(os.path.join(out, WEIGHTS_FILE), tensors, {"format": "pt"})
    return {"architecture": cfg.architectures[0],
            "tokenizer": _write_tokenizer(out, tokenizer, dims["vocab_size"])}


def _write_tokenizer(out: str, tokenizer: str | None, vocab_size: int) -> str | None:
    """The run's tokenizer into `out`: a tokenizer.json as a fast tokenizer, a
    SentencePiece model copied as it is; without one, bytes for a byte model."""
    if tokenizer is not None and tokenizer.endswith(".json"):
        from jtrain.data.tokenizer import EOS_NAMES

        fast = _transformers().PreTrainedTokenizerFast(tokenizer_file=tokenizer,
                                                       clean_up_tokenization_spaces=False)
        eos = next((n for n in EOS_NAMES if n in fast.get_vocab()), None)
        if eos is not None:
            fast.eos_token = eos
        fast.save_pretrained(out)
        return "tokenizer.json"
    if tokenizer is not None:
        shutil.copyfile(tokenizer, os.path.join(out, os.path.basename(tokenizer)))
        return "sentencepiece (tokenizer.model copied, not converted)"
    if vocab_size == 256:
        byte_tokenizer().save_pretrained(out)
        return "bytes"
    return None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (what tokenizers' ByteLevel
    pre-tokenizer maps bytes to)."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer():
    """A fast tokenizer whose token id is the byte: UTF-8 text -> its bytes, and back."""
    transformers = _transformers()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok,
                                                clean_up_tokenization_spaces=False)
