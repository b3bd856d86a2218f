"""The built-in byte-level corpus: a fixed list of modules from Python's own standard
library, present on every machine with Python, so the reference run needs no download.

The exact bytes depend on the Python version, so the corpus is fingerprinted (SHA-256
over file names and contents) and the fingerprint is recorded with every run.
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig

import numpy as np

# Paths relative to the stdlib directory. Where a module moved between Python versions
# (zipfile.py -> zipfile/__init__.py) the alternatives are listed together.
FILES = (
    "argparse.py", "ast.py", "calendar.py", "collections/__init__.py", "configparser.py",
    "csv.py", "dataclasses.py", "datetime.py", "difflib.py", "email/message.py", "enum.py",
    "fractions.py", "functools.py", "gettext.py", "heapq.py", "inspect.py",
    "json/decoder.py", "json/encoder.py", "logging/__init__.py", "os.py", "pathlib.py",
    "pickle.py", "pprint.py", "random.py", "shutil.py", "statistics.py", "string.py",
    "subprocess.py", "tarfile.py", "textwrap.py", "threading.py", "typing.py",
    "unittest/case.py", "urllib/parse.py", ("zipfile.py", "zipfile/__init__.py"),
    "_pydecimal.py", "doctest.py", "locale.py", "tempfile.py",
)
MIN_BYTES = 1_000_000  # fewer than this means the stdlib is not the one we expect


class CorpusError(ValueError):
    pass


def load_corpus(stdlib_dir: str | None = None) -> tuple[np.ndarray, str, list[str]]:
    """(bytes as uint8 [N], sha256 fingerprint, the files used)."""
    root = stdlib_dir or sysconfig.get_paths()["stdlib"]
    digest = hashlib.sha256()
    chunks, used = [], []
    for entry in FILES:
        for rel in (entry if isinstance(entry, tuple) else (entry,)):
            path = os.path.join(root, rel)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    data = f.read()
                digest.update(rel.encode() + b"\0" + data)
                chunks.append(data)
                used.append(rel)
                break
    corpus = np.frombuffer(b"\n".join(chunks), dtype=np.uint8)
    if corpus.size < MIN_BYTES:
        raise CorpusError(
            f"data.name: the Python standard library under {root!r} has only "
            f"{corpus.size} bytes of the corpus files (need {MIN_BYTES})")
    return corpus, digest.hexdigest(), used


class ByteChunks:
    """Map-style source of non-overlapping windows: inputs = w[:-1], targets = w[1:]."""

    def __init__(self, corpus: np.ndarray, starts: np.ndarray, seq_len: int, name: str):
        self._corpus, self._starts, self._seq_len, self._name = corpus, starts, seq_len, name

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, index):
        s = int(self._starts[index])
        window = self._corpus[s:s + self._seq_len + 1].astype(np.int32)
        return {"inputs": window[:-1], "targets": window[1:]}

    def __repr__(self) -> str:  # deterministic: grain compares it on restore
        return f"ByteChunks({self._name}, n={len(self)}, seq_len={self._seq_len})"


def make_pystdlib(seq_len: int, val_fraction: float):
    """(train source, eval source, info) for the byte-level LM corpus; the held-out
    windows are split_windows'."""
    corpus, fingerprint, used = load_corpus()
    train_starts, val_starts = split_windows(
        np.arange((corpus.size - 1) // seq_len) * seq_len, val_fraction)
    info = {
        "name": "pystdlib",
        "fingerprint": fingerprint,
        "num_files": len(used),
        "num_bytes": int(corpus.size),
        "unigram_baseline": unigram_cross_entropy(corpus, train_starts, val_starts, seq_len),
    }
    return (ByteChunks(corpus, train_starts, seq_len, "train"),
            ByteChunks(corpus, val_starts, seq_len, "val") if len(val_starts) else None,
            info)


def split_windows(starts: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train starts, held-out starts), each sorted: a fixed permutation (seed 0,
    independent of the run's seed), so every run holds out the same windows."""
    order = np.random.default_rng(0).permutation(len(starts))
    n_val = max(1, int(round(len(starts) * val_fraction))) if val_fraction > 0 else 0
    return np.sort(starts[order[n_val:]]), np.sort(starts[order[:n_val]])


def unigram_cross_entropy(corpus, train_starts, val_starts, seq_len) -> float:
    """Cross-entropy (nats/byte) of held-out targets under the training set's byte
    frequencies (add-one smoothed): the loss a model that ignores context would get."""
    if len(val_starts) == 0:
        return float("nan")

    def targets(starts):
        idx = (starts[:, None] + 1 + np.arange(seq_len)[None, :]).ravel()
        return corpus[idx]

    counts = np.bincount(targets(train_starts), minlength=256).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[targets(val_starts)].mean()) if math.isfinite(logp.sum()) else float("nan")
