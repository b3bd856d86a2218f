"""Tokenizers for language-model text: bytes (the default), a Hugging Face
`tokenizer.json` (trained here as BPE or unigram, or the user's own), a SentencePiece
`.model`. Both files are data: reading one runs no code (no `trust_remote_code`, no
pickle); a file that does not parse is one DataError naming it.

Every tokenizer has `kind`, `vocab_size`, `eos` (the id appended after each document, or
None), `file` (None for bytes), `fingerprint` (the file's SHA-256, "byte" for bytes) and
`encode(text) -> uint32 array` and `decode(ids) -> str` (ids past the vocabulary left
out; invalid UTF-8 replaced). The packages (the `lm` extra) are imported only here,
when a tokenizer other than bytes is asked for.
"""

from __future__ import annotations

import hashlib
import os
from typing import Iterable

import numpy as np

from jtrain.errors import DataError, first_line

BYTE = "byte"
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>")  # the document separator, if the vocab has one
TRAINED = ("bpe", "unigram")


def _package(name: str):
    try:
        return __import__(name)
    except ImportError:
        raise DataError("--tokenizer", f"needs the {name} package: pip install "
                        "'jtrain[lm]'") from None


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocab 256): what the built-in corpus trains on."""

    kind, vocab_size, eos, file, fingerprint = BYTE, 256, None, None, BYTE

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.uint32)

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer read from its tokenizer.json."""

    kind = "hf"

    def __init__(self, path: str):
        tokenizers = _package("tokenizers")
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # the Rust parser's error: the first line of it
            raise DataError(path, f"not a Hugging Face tokenizer.json: {first_line(e)}") \
                from None
        self.file, self.fingerprint = path, file_sha256(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        ids = [self._tok.token_to_id(name) for name in EOS_NAMES]
        self.eos = next((i for i in ids if i is not None), None)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.uint32)

    def decode(self, ids) -> str:  # as transformers' tokenizer.decode(ids) does
        return self._tok.decode(list(ids), skip_special_tokens=False)


class SentencePieceTokenizer:
    """A SentencePiece model (`.model`, a protobuf) as it is."""

    kind = "sentencepiece"

    def __init__(self, path: str):
        spm = _package("sentencepiece")
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(path)
        except Exception as e:
            raise DataError(path, f"not a SentencePiece model: {first_line(e)}") from None
        self.file, self.fingerprint = path, file_sha256(path)
        self.vocab_size = int(self._sp.GetPieceSize())
        self.eos = int(self._sp.eos_id()) if self._sp.eos_id() >= 0 else None

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.EncodeAsIds(text), np.uint32)

    def decode(self, ids) -> str:
        return self._sp.DecodeIds([i for i in ids if i < self.vocab_size])


def load(spec: str):
    """"byte", a tokenizer.json or a .model file -> its tokenizer."""
    if spec == BYTE:
        return ByteTokenizer()
    if not os.path.isfile(spec) or not spec.endswith((".json", ".model")):
        raise DataError(spec, "not a tokenizer file: give byte, a tokenizer.json, a "
                        "SentencePiece .model, or bpe:N / unigram:N to train one")
    return SentencePieceTokenizer(spec) if spec.endswith(".model") else HFTokenizer(spec)


def parse_trained(spec: str) -> tuple[str, int] | None:
    """("bpe" | "unigram", vocab) for "bpe:N" / "unigram:N"; None for anything else."""
    kind, sep, n = spec.partition(":")
    if kind not in TRAINED or not sep:
        return None
    if not n.isdigit() or not 257 < int(n) < 1 << 32:
        raise DataError("--tokenizer", f"{spec}: the vocabulary size must be an integer "
                        "above 257 (the 256 bytes and the document separator)")
    return kind, int(n)


def train(kind: str, vocab_size: int, texts: Iterable[str], out_file: str) -> HFTokenizer:
    """A byte-level BPE or unigram tokenizer with `vocab_size` entries (fewer when the
    text is too small to fill them) learnt from `texts`, saved as `out_file`
    (tokenizer.json) and read back. Every byte is in its alphabet, so any text encodes."""
    tokenizers = _package("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if kind == "bpe":
        tok = tokenizers.Tokenizer(models.BPE())
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_NAMES[0]],
                                      initial_alphabet=alphabet, show_progress=False)
    else:
        tok = tokenizers.Tokenizer(models.Unigram())
        trainer = trainers.UnigramTrainer(vocab_size=vocab_size,
                                          special_tokens=[EOS_NAMES[0]],
                                          initial_alphabet=alphabet, show_progress=False)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(out_file)
    return HFTokenizer(out_file)
