"""`jtrain tokenize` (= `python -m jtrain tokenize`): text files -> token shards that a
run reads with data.name=tokens, data.path=DIR (jtrain/data/tokens.py has the format)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from jtrain.data import tokenizer as tokenizer_lib, tokens
from jtrain.errors import UsageError

PROG = "python -m jtrain tokenize"
DESCRIPTION = ("Tokenize text files (plain text, JSONL, Parquet) once into token shards "
               "for data.name=tokens.")


def define_flags(fv, argv=None) -> None:
    from absl import flags

    flags.DEFINE_string("input", None, "comma-separated files or globs: .txt (any other "
                        "name: the whole file is one document), .jsonl, .parquet "
                        "(needs pyarrow)", flag_values=fv)
    flags.DEFINE_string("out", None, "the folder written (or s3:// / gs://bucket/prefix, "
                        "uploaded): shard-NNNNN.bin, index.json, the tokenizer's copy",
                        flag_values=fv)
    flags.DEFINE_string("tokenizer", "byte", "byte | a tokenizer.json | a SentencePiece "
                        ".model | bpe:N | unigram:N (trained on --input with vocab N)",
                        flag_values=fv)
    flags.DEFINE_string("text_field", "text", "the field of a JSONL record / Parquet "
                        "column holding the text", flag_values=fv)
    flags.DEFINE_integer("shard_tokens", tokens.SHARD_TOKENS, "tokens per shard",
                         lower_bound=1, flag_values=fv)


def main(fv, args, argv=None) -> int:
    if args:
        raise UsageError(f"jtrain tokenize takes flags only, got {' '.join(args)!r}")
    if not fv.input or not fv.out:
        raise UsageError("usage: jtrain tokenize --input=FILES_OR_GLOBS --out=DIR "
                         "[--tokenizer=byte|PATH|bpe:N|unigram:N]")
    files = tokens.input_files(fv.input)
    remote = tokens.is_remote(fv.out)
    fs = tokens.remote_fs(fv.out, "--out") if remote else None
    if (fs.exists(f"{fv.out.rstrip('/')}/{tokens.INDEX}") if remote
            else os.path.exists(os.path.join(fv.out, tokens.INDEX))):
        raise UsageError(f"--out: {fv.out} holds token shards already (nothing "
                         "overwritten; choose another folder or remove it)")
    if remote:  # written in a local temporary folder, then uploaded, index.json last
        with tempfile.TemporaryDirectory(prefix="jtrain-tokenize-") as tmp:
            index = _write(fv, files, tmp)
            names = sorted(os.listdir(tmp), key=lambda n: n == tokens.INDEX)
            try:
                for name in names:
                    fs.put_file(os.path.join(tmp, name), f"{fv.out.rstrip('/')}/{name}")
            except OSError as e:
                raise UsageError(f"--out: {fv.out}: the upload failed ({type(e).__name__} "
                                 f"{e}); nothing is read from it without its index.json") \
                    from None
    else:
        index = _write(fv, files, fv.out)
    print(json.dumps({k: index[k] for k in ("num_tokens", "num_documents", "vocab_size",
                                            "dtype", "fingerprint")}
                     | {"shards": len(index["shards"]), "out": fv.out}))
    return 0


def _write(fv, files, out: str) -> dict:
    def docs():
        for path in files:
            yield from tokens.documents(path, fv.text_field)

    trained = tokenizer_lib.parse_trained(fv.tokenizer)
    tok = None if trained is not None else tokenizer_lib.load(fv.tokenizer)
    os.makedirs(out, exist_ok=True)  # after every check of the flags
    if tok is None:
        tok = tokenizer_lib.train(*trained, docs(), os.path.join(out, "tokenizer.json"))
    elif tok.file is not None:  # the folder carries its tokenizer
        copy = os.path.join(out, "tokenizer" + os.path.splitext(tok.file)[1])
        if not os.path.exists(copy) or not os.path.samefile(copy, tok.file):
            shutil.copyfile(tok.file, copy)
        tok.file = copy
    return tokens.write_shards(tok, docs(), out, fv.shard_tokens)
