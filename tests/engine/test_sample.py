"""Sampling (jtrain/engine/sample.py): greedy decoding equals transformers' generate on the
Hugging Face export token for token; the KV cache gives the full forward's logits and the
window recomputed without it the same tokens; the seed decides the draw; top_k=1 is
greedy; top-k / top-p keep what they say; stop strings cut; a batch of prompts of
different lengths equals each prompt alone; text goes through a unigram or SentencePiece
tokenizer and back; the end-of-run sample is one line where it cannot decode; bad input
is one line. A tiny random
built-in transformer (2 layers, width 32, 256 bytes), no training: the run-directory
side is tests/journeys/test_sample_journey.py. The Python example of
docs/guide/language-models.md is what these tests call."""

import os
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jtrain
from jtrain import errors
from jtrain.checkpoint import hf_export
from jtrain.data import tokenizer
from jtrain.checkpoint.integrity import leaf_path
from jtrain.engine import sample as sample_lib
from jtrain.models.transformer import Transformer

DIMS = dict(vocab_size=256, d_model=32, num_layers=2, num_heads=4, d_ff=64, max_len=48)
PROMPTS = ["def f(x):", "import", "class Point:\n    "]


def tiny(mlp="swiglu", tie=True, seed=0):
    """(module, params) of a random tiny transformer; weights scaled up so the greedy
    path wanders over many bytes instead of repeating one."""
    m = Transformer(**DIMS, dropout=0.0, tie_embeddings=tie, mlp=mlp)
    params = m.init(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32))["params"]
    params = jax.tree.map(lambda p: getattr(p, "value", p) * 2.0, params,
                          is_leaf=lambda p: hasattr(p, "value"))
    return m, params


@pytest.fixture(scope="module")
def model():
    return tiny()


def tokens(out):
    return [s.tokens for s in out]


@pytest.fixture(scope="module")
def tf():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers, torch


@pytest.mark.parametrize("mlp,tie", [("swiglu", True), ("gelu", False)])
def test_greedy_equals_transformers_generate_token_for_token(tf, tmp_path, mlp, tie):
    transformers, torch = tf
    m, params = tiny(mlp, tie, seed=1)
    leaves = {leaf_path(p): np.asarray(v)
              for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    hf_export.write(str(tmp_path), leaves, {"model": {"name": "transformer",
                                                      "max_len": DIMS["max_len"]}})
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    ours = jtrain.sample(params, PROMPTS, model=m, max_new_tokens=24)  # one batch
    for prompt, got in zip(PROMPTS, ours, strict=True):
        ids = torch.tensor([list(prompt.encode())])
        with torch.no_grad():
            theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=24, pad_token_id=0)
        assert got.tokens == theirs[0, ids.shape[1]:].tolist()
        assert got.finish == "length" and len(set(got.tokens)) > 3  # not one byte repeated


def test_the_cache_gives_the_full_forward_logits(model):
    m, params = model
    seq = jnp.asarray([list(b"def main():\n    return")], jnp.int32)  # [1, 22]
    full = m.apply({"params": params}, seq)  # [1, 22, V]: the training forward
    pad = 5  # the row left-padded, as in a batch with a longer prompt
    cache = m.init_cache(1, 32)
    head = jnp.concatenate([jnp.full((1, pad), 7, jnp.int32), seq[:, :10]], axis=1)
    logits, cache = m.apply({"params": params}, head, cache=cache, pad=jnp.array([pad]))
    got = [logits[:, pad:]]
    for t in range(10, 22):  # one token per call
        logits, cache = m.apply({"params": params}, seq[:, t:t + 1], cache=cache,
                                pad=jnp.array([pad]))
        got.append(logits)
    np.testing.assert_allclose(jnp.concatenate(got, axis=1), full, atol=2e-5, rtol=0)
    assert int(cache["index"]) == pad + 22


@pytest.mark.parametrize("settings", [{}, {"temperature": 0.9, "top_k": 20, "top_p": 0.9}])
def test_with_and_without_the_cache_the_same_tokens(model, settings):
    m, params = model
    kw = dict(model=m, max_new_tokens=16, seed=3, **settings)
    assert (tokens(jtrain.sample(params, PROMPTS, **kw))
            == tokens(jtrain.sample(params, PROMPTS, use_cache=False, **kw)))


def test_the_seed_decides_the_draw_and_top_k_1_is_greedy(model):
    m, params = model
    kw = dict(model=m, max_new_tokens=16, temperature=1.0)
    a, b, c = (tokens(jtrain.sample(params, PROMPTS, seed=s, **kw)) for s in (5, 5, 6))
    assert a == b and a != c
    greedy = tokens(jtrain.sample(params, PROMPTS, model=m, max_new_tokens=16))
    assert tokens(jtrain.sample(params, PROMPTS, seed=5, top_k=1, **kw)) == greedy
    assert a != greedy


def test_top_k_and_top_p_keep_only_their_tokens():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 64))  # [B, V], one row per draw
    one = jnp.float32(1.0)

    def drawn(k, p):
        return {int(t) for seed in range(8) for t in sample_lib.choose(
            logits, jax.random.key(seed), one, jnp.int32(k), jnp.float32(p), False)}

    assert drawn(0, 1.0) == {0, 1, 2, 3}
    assert drawn(2, 1.0) == {0, 1}
    assert drawn(0, 0.7) == {0, 1}  # 0.5 + 0.3 reach 0.7
    assert drawn(0, 0.5) == {0}
    assert drawn(3, 0.83) == {0, 1}  # over the renormalised top 3: 0.53 + 0.32 >= 0.83


def test_a_stop_string_cuts_the_continuation_before_it(model):
    m, params = model
    full = jtrain.sample(params, PROMPTS[0], model=m, max_new_tokens=24)[0].tokens
    at = next(i for i, t in enumerate(full) if i > 0 and t < 128)  # an ASCII byte
    out = jtrain.sample(params, PROMPTS[0], model=m, max_new_tokens=24, stop=[chr(full[at])])
    assert out[0].tokens == full[:full.index(full[at])] and out[0].finish == "stop"
    tok, row = tokenizer.ByteTokenizer(), [104, 105, 10]  # a stop of two tokens: checked
    assert sample_lib._stopped(tok, [], row, ["\n\n", "x"]) is None  # as each token comes
    row.append(10)
    assert sample_lib._stopped(tok, [], row, ["\n\n", "x"]) == "hi" and row == [104, 105]

    class Pieces:  # tokens of several characters: the stop string inside the second
        vocab_size, pieces = 3, ["ab", "c\nd", "e"]

        def decode(self, ids):
            return "".join(self.pieces[i] for i in ids)
    row = [0, 1]  # the text is cut at the stop, the token reaching into it dropped
    assert sample_lib._stopped(Pieces(), [2], row, ["\n"]) == "abc" and row == [0]


def test_the_end_of_run_sample_is_off_in_one_line_where_it_cannot_decode():
    run = SimpleNamespace(build=SimpleNamespace(model_name="transformer"),
                          data=SimpleNamespace(info={}))
    for over, why in (({"population": {"size": 2}}, "trained a population"),
                      ({"finetune": {"lora": {"rank": 2}}}, "holds LoRA adapters"),
                      ({"step": {"factory": "m:f"}}, "trained a step of your own"),
                      ({"model": {"quant": "int8"}}, "trained with model.quant=int8")):
        cfg = jtrain.resolve({**over, "sample": {"prompts": ["def "]}})
        (line,) = sample_lib.end_of_run(cfg, run, None)
        assert line.startswith(f"jtrain: sample: off: {why}"), line
    cfg = jtrain.resolve({"sample": {"prompts": ["def "]}})
    user = SimpleNamespace(build=SimpleNamespace(model_name="user Net"))
    assert sample_lib.end_of_run(cfg, user, None) == [
        "jtrain: sample: off: model user Net is not the built-in transformer"]
    for off in ({"prompts": []}, {"prompts": ["def "], "max_new_tokens": 0}):
        assert sample_lib.end_of_run(jtrain.resolve({"sample": off}), user, None) == []


def test_a_batch_of_different_lengths_equals_each_prompt_alone(model):
    m, params = model
    batch = jtrain.sample(params, PROMPTS, model=m, max_new_tokens=20)
    for prompt, got in zip(PROMPTS, batch, strict=True):
        assert got == jtrain.sample(params, prompt, model=m, max_new_tokens=20)[0]


def test_the_context_bounds_prompt_and_continuation(model):
    m, params = model
    with pytest.raises(errors.UsageError) as e:
        jtrain.sample(params, "x" * 49, model=m)
    assert errors.render(e.value) == ("jtrain: usage error: --prompt: 49 tokens, the "
                                      "model's context is 48")
    out = jtrain.sample(params, "x" * 40, model=m, max_new_tokens=20)[0]
    assert len(out.tokens) == 8 and out.finish == "context"


def test_a_model_without_the_decode_interface_is_refused_in_one_line():
    m = jtrain.make_model({"name": "mlp", "hidden": (4,), "num_outputs": 3},
                          dtype="float32", param_dtype="float32")
    with pytest.raises(errors.UsageError) as e:
        jtrain.sample({}, [[1, 2]], model=m)
    line = errors.render(e.value)
    assert line.startswith("jtrain: usage error: model: MLP has no max_len, init_cache")
    assert "\n" not in line


@pytest.mark.parametrize("kind", ["unigram", "sentencepiece"])
def test_text_goes_through_the_tokenizer_and_a_batch_decodes_as_each_row_alone(kind,
                                                                              tmp_path):
    text = "".join(f"def f{i}(x):\n    return x * {i}\nclass Point{i}:\n    pass\n"
                   for i in range(40))
    if kind == "sentencepiece":
        import sentencepiece as spm

        (tmp_path / "c.txt").write_text(text)
        spm.SentencePieceTrainer.train(input=str(tmp_path / "c.txt"), vocab_size=60,
                                       model_prefix=str(tmp_path / "sp"), minloglevel=2)
        path = str(tmp_path / "sp.model")
    else:
        path = tokenizer.train("unigram", 300, [text], str(tmp_path / "tokenizer.json")).file
    tok = tokenizer.load(path)
    m = Transformer(**{**DIMS, "vocab_size": tok.vocab_size + 3}, dropout=0.0,
                    tie_embeddings=True)
    params = m.init(jax.random.key(2), jnp.zeros((1, 4), jnp.int32))["params"]
    params = jax.tree.map(lambda p: getattr(p, "value", p) * 3.0, params,
                          is_leaf=lambda p: hasattr(p, "value"))
    prompts = ["def f1(x", "class Point"]  # of different token lengths: left-padded
    batch = jtrain.sample(params, prompts, model=m, max_new_tokens=10, tokenizer=path)
    for prompt, got in zip(prompts, batch, strict=True):
        ids = tok.encode(prompt).tolist()
        assert got == jtrain.sample(params, [ids], model=m, max_new_tokens=10,
                                    tokenizer=path)[0]  # ids or text: the same row
        assert prompt + got.text == tok.decode(ids + got.tokens)  # what the CLI prints
    assert len({len(tok.encode(p)) for p in prompts}) == 2
    head, whole = tok.encode("class").tolist(), tok.encode("class Point1").tolist()
    assert whole[:len(head)] == head  # a word's leading space (SentencePiece's too) kept:
    assert sample_lib.decoded(tok, head, whole[len(head):]) == " Point1"
    stop = batch[0].text[3:5]  # found in the decoded text, whatever tokens it spans
    cut = jtrain.sample(params, prompts[0], model=m, max_new_tokens=10, stop=[stop],
                        tokenizer=path)[0]
    assert cut.finish == "stop" and cut.text == batch[0].text[:batch[0].text.index(stop)]
