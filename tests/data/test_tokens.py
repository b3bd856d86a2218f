"""Tokenizers (bytes, trained BPE / unigram, a tokenizer.json, a SentencePiece model),
token shards written by `jtrain tokenize` and read back by data.name=tokens, and each
bad input as one line naming its file."""

import json

import numpy as np
import pytest

from jtrain import config as config_lib, data as data_lib
from jtrain.checkpoint import hf_export
from jtrain.cli import tokenize as tokenize_cmd
from jtrain.data import tokenizer as tokenizer_lib, tokens
from jtrain.errors import ConfigError, DataError, render

DOCS = [f"def f{i}(x):\n    return x * {i}  # héllo wörld €\n" * 3 for i in range(40)]


class Flags:  # the flag values `jtrain tokenize` parses
    def __init__(self, **kw):
        self.text_field, self.shard_tokens, self.tokenizer = "text", 500, "byte"
        vars(self).update(kw)


def tokenize(tmp_path, name="shards", **kw):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    out = tmp_path / name
    assert tokenize_cmd.main(Flags(input=str(corpus), out=str(out), **kw), []) == 0
    return out


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_a_trained_tokenizer_loads_back_and_encodes_alike(tmp_path, kind):
    tok = tokenizer_lib.train(kind, 300, iter(DOCS), str(tmp_path / "tokenizer.json"))
    again = tokenizer_lib.load(str(tmp_path / "tokenizer.json"))
    text = "def g(y):\n    return y - 1  # ünïcode ✓ and bytes never seen: \x00\x7f"
    assert 256 < tok.vocab_size <= 300 and tok.eos == 0
    assert np.array_equal(tok.encode(text), again.encode(text))
    assert again.fingerprint == tokenizer_lib.file_sha256(str(tmp_path / "tokenizer.json"))
    if kind == "bpe":  # merges learnt: fewer tokens than bytes
        assert len(tok.encode(DOCS[0])) < len(DOCS[0].encode()) / 2


def test_a_sentencepiece_model_loads_as_it_is(tmp_path):
    import sentencepiece as spm

    (tmp_path / "c.txt").write_text("".join(DOCS))
    spm.SentencePieceTrainer.train(input=str(tmp_path / "c.txt"), vocab_size=60,
                                   model_prefix=str(tmp_path / "sp"), minloglevel=2)
    tok = tokenizer_lib.load(str(tmp_path / "sp.model"))
    ref = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    assert tok.kind == "sentencepiece" and tok.vocab_size == 60 and tok.eos == ref.eos_id()
    assert tok.encode(DOCS[3]).tolist() == ref.encode(DOCS[3])


def test_shards_read_back_equal_the_text_encoded_directly(tmp_path):
    out = tokenize(tmp_path, tokenizer="bpe:300")
    index = json.loads((out / "index.json").read_text())
    tok = tokenizer_lib.load(str(out / "tokenizer.json"))
    want = np.concatenate([np.append(tok.encode(d), tok.eos) for d in DOCS])
    got = np.concatenate([np.fromfile(out / s["file"], "<u2") for s in index["shards"]])
    assert len(index["shards"]) > 2 and np.array_equal(got, want)
    assert index["vocab_size"] == tok.vocab_size and index["num_documents"] == len(DOCS)
    train, val, info = tokens.make_tokens(16, 0.0, str(out))
    assert val is None and info["fingerprint"] == index["fingerprint"]
    bases = np.cumsum([0] + [s["tokens"] for s in index["shards"]])
    windows = [w for b, e in zip(bases[:-1], bases[1:], strict=True) for w in range(b, e - 16, 16)]
    assert len(train) == len(windows)
    for i in (0, 1, len(train) // 2, len(train) - 1):
        item, s = train[i], windows[i]
        assert np.array_equal(item["inputs"], want[s:s + 16])
        assert np.array_equal(item["targets"], want[s + 1:s + 17])


def test_a_byte_corpus_trains_with_bits_per_byte_and_a_changed_shard_is_one_line(tmp_path):
    out = tokenize(tmp_path)
    assert not (out / "tokenizer.json").exists()
    cfg = config_lib.resolve({"data": {"name": "tokens", "path": str(out), "seq_len": 16,
                                       "batch_size": 2}})
    run = data_lib.prepare(cfg.data, data_lib.UserData(), seed=0, model_cfg=cfg.model)
    assert run.byte_level and run.info["vocab_size"] == 256
    shard = out / "shard-00001.bin"
    raw = bytearray(shard.read_bytes())
    raw[3] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError) as e:
        tokens.make_tokens(16, 0.05, str(out))
    assert render(e.value) == (f"jtrain: data error: {out}/shard-00001.bin: its sha256 "
                               "differs from index.json's (the shard changed after jtrain "
                               "tokenize)")


def test_the_config_names_the_tokenizer_and_a_pinned_other_one_is_one_line(tmp_path):
    out = tokenize(tmp_path, tokenizer="bpe:300")
    made = json.loads((out / "index.json").read_text())["tokenizer"]["fingerprint"]
    user = data_lib.UserData()
    cfg = config_lib.resolve({"data": {"name": "tokens", "path": str(out)}},
                             data_settings=user.settings)
    assert cfg.data.tokenizer == f"tokenizer.json (sha256 {made})"
    again = config_lib.resolve(cfg.to_dict(), data_settings=data_lib.UserData().settings)
    assert again.data.tokenizer == cfg.data.tokenizer  # a resume's config: the same
    with pytest.raises(DataError) as e:
        config_lib.resolve({"data": {"name": "tokens", "path": str(out), "tokenizer": "byte"}},
                           data_settings=data_lib.UserData().settings)
    assert render(e.value) == (f"jtrain: data error: data.tokenizer: 'byte', but the shards "
                               f"in {out} were made with 'tokenizer.json (sha256 {made})'")


def test_model_vocab_below_the_tokenizers_is_one_config_line(tmp_path):
    out = tokenize(tmp_path, tokenizer="bpe:300")
    vocab = json.loads((out / "index.json").read_text())["vocab_size"]
    cfg = config_lib.resolve({"data": {"name": "tokens", "path": str(out), "seq_len": 16},
                              "model": {"vocab_size": 256}})
    with pytest.raises(ConfigError) as e:
        data_lib.prepare(cfg.data, data_lib.UserData(), seed=0, model_cfg=cfg.model)
    assert render(e.value) == (
        f"jtrain: config error: model.vocab_size: 256 is below the vocab size of "
        f"data.path's tokenizer ({vocab}); set model.vocab_size >= {vocab}")


def test_bad_input_is_one_line_naming_the_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "cut\n')
    with pytest.raises(DataError) as e:
        list(tokens.documents(str(bad)))
    assert render(e.value).startswith(f"jtrain: data error: {bad}:2: not JSON (")
    (tmp_path / "tokenizer.json").write_text('{"model": ')
    for name in ("tokenizer.json", "tokenizer.model"):
        (tmp_path / name).write_bytes(b'{"model": ')
        with pytest.raises(DataError) as e:
            tokenizer_lib.load(str(tmp_path / name))
        line = render(e.value)
        assert line.startswith(f"jtrain: data error: {tmp_path / name}: not a ") \
            and "\n" not in line, line
    table = str(tmp_path / "t.parquet")
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:  # refused in one line
        (tmp_path / "t.parquet").write_bytes(b"PAR1")
        with pytest.raises(DataError, match=r"t.parquet: reading Parquet needs pyarrow"):
            list(tokens.documents(table))
    else:  # read: the column's values are the documents
        pq.write_table(pa.table({"text": ["one doc", "two"]}), table)
        assert list(tokens.documents(table)) == ["one doc", "two"]


def test_the_hf_export_carries_the_tokenizer_and_encodes_identically(tmp_path):
    out = tokenize(tmp_path, tokenizer="bpe:300")
    assert hf_export._write_tokenizer(str(tmp_path / "hf"), str(out / "tokenizer.json"),
                                      320) == "tokenizer.json"
    import transformers

    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ours = tokenizer_lib.load(str(out / "tokenizer.json"))
    for text in DOCS[:3] + ["  leading spaces, ünïcode ✓\n\ttabs"]:
        assert auto(text)["input_ids"] == ours.encode(text).tolist()
    assert auto.eos_token == "<|endoftext|>" and auto.eos_token_id == ours.eos


@pytest.mark.parametrize("field,value,why", [
    ("file", "../shard-00000.bin", "'../shard-00000.bin' is not a file name inside the folder"),
    ("file", "/etc/passwd", "'/etc/passwd' is not a file name inside the folder"),
    ("file", "sub/shard.bin", "'sub/shard.bin' is not a file name inside the folder"),
    ("file", "..", "'..' is not a file name inside the folder"),
    ("file", 7, "7 is not a file name inside the folder"),
    ("tokens", -1, "shards[0].tokens: -1 is not a non-negative integer"),
    ("tokens", True, "shards[0].tokens: True is not a non-negative integer"),
    ("sha256", None, "shards[0].sha256: None is not a string"),
])
def test_a_hostile_or_mistyped_index_is_one_line_naming_the_field(tmp_path, field, value, why):
    """Re-fingerprinted as a hostile writer would: the fingerprint alone does not catch it."""
    out = tokenize(tmp_path)
    index = json.loads((out / "index.json").read_text())
    index["shards"][0][field] = value
    index["fingerprint"] = tokens.fingerprint(index)
    (out / "index.json").write_text(json.dumps(index))
    with pytest.raises(DataError) as e:
        tokens.make_tokens(16, 0.0, str(out))
    line = render(e.value)
    assert line.startswith(f"jtrain: data error: {out}/index.json: ") and why in line, line
    assert tokens.tokenizer_name(str(out)) is None  # the config's resolution says nothing


def test_shards_on_a_bucket_outside_a_run_are_one_line(tmp_path):
    with pytest.raises(DataError) as e:
        tokens._fetch("s3://bucket/shards", "f" * 64, [], None)
    assert render(e.value) == ("jtrain: data error: data.path: s3://bucket/shards: shards on "
                               "an object store are read by a run, into its workdir (train "
                               "with --workdir, or copy them to a local folder)")
    with pytest.raises(DataError, match="none in the URI"):
        tokens.remote_fs("s3://key:secret@bucket/shards")


def test_packing_token_shards_is_refused_in_one_line(tmp_path):
    out = tokenize(tmp_path)
    cfg = config_lib.resolve({"data": {"name": "tokens", "path": str(out), "seq_len": 16,
                                       "packing": "concat"}, "model": {"name": "mlp"}})
    with pytest.raises(DataError) as e:
        data_lib.make_sources(cfg.data)
    assert render(e.value) == (
        "jtrain: data error: data.packing: 'concat' with data.name=tokens: its windows "
        "already run across document boundaries; set data.packing=none, or pack your "
        "documents (data.source) instead")
