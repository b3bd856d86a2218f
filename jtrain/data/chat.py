"""Conversations for instruction tuning (data.name=chat) and preference pairs (the DPO
recipe, jtrain/recipes/dpo.py), rendered through a chat template.

A template is a plain string holding `{role}` once and `{content}` once after it, e.g.
the default "<|{role}|>\\n{content}<|end|>\\n": each message is the part before
`{content}` (its header, the role filled in), the content, then the part after (its end,
the role filled in). The template is substituted as text, never formatted or executed,
so a config or a data file cannot run code through it.

Each piece is tokenized on its own with the run's tokenizer (bytes by default) and the
pieces concatenated, so every token belongs to one piece. A token's weight is 1 on an
assistant message's content and end (the model learns to answer and to stop), 0 on
everything else (system and user messages, every header): the loss of the built-in step
falls on completion tokens only, through packing's per-target weights (packing.py).
"""

from __future__ import annotations

import numpy as np

from jtrain.data import packing, text, tokenizer as tokenizer_lib, tokens
from jtrain.errors import DataError

TEMPLATE = "<|{role}|>\n{content}<|end|>\n"
ASSISTANT = "assistant"


def split_template(template: str) -> tuple[str, str]:
    """(header, end) of a template, each still holding {role} where the template does."""
    if template.count("{content}") != 1 or template.count("{role}") != 1 or \
            template.index("{role}") > template.index("{content}"):
        raise DataError("data.chat_template", f"{template!r}: needs {{role}} once, then "
                        "{content} once")
    head, end = template.split("{content}")
    return head, end


def pieces(messages, template: str, prompt: bool = False) -> list[tuple[str, bool]]:
    """The conversation as (text, trained) pieces; `prompt`: then an assistant header
    (what a model continues to answer)."""
    head, end = split_template(template)
    out = []
    for m in messages:
        trained = m["role"] == ASSISTANT
        out += [(head.replace("{role}", m["role"]), False), (m["content"], trained),
                (end.replace("{role}", m["role"]), trained)]
    if prompt:
        out.append((head.replace("{role}", ASSISTANT), False))
    return [(t, w) for t, w in out if t]


def render(messages, template: str = TEMPLATE, prompt: bool = False) -> str:
    """The conversation as text (with `prompt`, ending in an assistant header)."""
    return "".join(t for t, _ in pieces(messages, template, prompt))


def encode(parts, tok) -> dict:
    """{"tokens": int32 [L], "weights": float32 [L]} of (text, trained) pieces."""
    ids = [np.asarray(tok.encode(t), np.int32) for t, _ in parts]
    weights = [np.full(len(i), float(w), np.float32) for i, (_, w) in zip(ids, parts,
                                                                          strict=True)]
    return {"tokens": np.concatenate(ids), "weights": np.concatenate(weights)}


def _messages(value, where: str) -> list:
    if not isinstance(value, list) or not value:
        raise DataError(where, "'messages' must be a non-empty list")
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and m["role"]
                and isinstance(m.get("content"), str)):
            raise DataError(where, f"messages[{i}] must be {{'role': str, 'content': str}}")
    if not any(m["role"] == ASSISTANT for m in value):
        raise DataError(where, "no assistant message (nothing to train on)")
    return value


def conversations(path: str) -> list[list[dict]]:
    """The `messages` of each line of a JSONL file; one DataError naming file:line."""
    out = []
    for where, record in tokens.jsonl_records(path):
        if not isinstance(record, dict) or "messages" not in record:
            raise DataError(where, "no 'messages' field")
        out.append(_messages(record["messages"], where))
    return out


def pairs(path: str) -> list[tuple[str, str, str]]:
    """(prompt, chosen, rejected) of each line of a JSONL file of preference pairs."""
    out = []
    for where, record in tokens.jsonl_records(path):
        keys = ("prompt", "chosen", "rejected")
        if not isinstance(record, dict) or not all(isinstance(record.get(k), str)
                                                   for k in keys):
            raise DataError(where, "needs string fields 'prompt', 'chosen', 'rejected'")
        out.append(tuple(record[k] for k in keys))
    return out


def tokenizer(spec: str):
    """data.tokenizer for chat data: '' or 'byte' = bytes, else a tokenizer file."""
    return tokenizer_lib.load(spec or tokenizer_lib.BYTE)


def make_chat(data_cfg):
    """(train windows, held-out windows or None, info) of data.path's conversations:
    whole conversations held out (text.split_windows), each split packed per
    data.packing ("none" packs one conversation per window, as "pad")."""
    if not data_cfg.path:
        raise DataError("data.path", "data.name=chat needs data.path: a JSONL file of "
                        "{\"messages\": [{\"role\": ..., \"content\": ...}]}")
    tok = tokenizer(data_cfg.tokenizer)
    docs = [encode(pieces(c, data_cfg.chat_template), tok)
            for c in conversations(data_cfg.path)]
    if len(docs) < 2:
        raise DataError("data.path", f"{data_cfg.path}: {len(docs)} conversation(s); "
                        "at least 2 are needed (one held out)")
    train, val = text.split_windows(np.arange(len(docs)), data_cfg.val_fraction)
    mode = "pad" if data_cfg.packing == "none" else data_cfg.packing

    def pack(index, name):
        return packing.Packed([docs[i] for i in index], data_cfg.seq_len, mode, name=name,
                              seed=data_cfg.split_seed, buffer=data_cfg.packing_buffer)

    info = {"name": "chat", "vocab_size": tok.vocab_size,
            "byte_level": tok.kind == tokenizer_lib.BYTE}
    return pack(train, "train"), pack(val, "val") if len(val) else None, info
