"""Chat data for SFT (data.name=chat, jtrain/data/chat.py): conversations rendered
through the template, packed, the loss on the assistant's tokens only (checked against
a hand computation over the logits that finds the answers in the text), and bad input
as one line naming the file and line; a run of it from the command line."""

import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from jtrain import losses
from jtrain.data import chat
from jtrain.errors import DataError

from journey import run_python

CONVERSATIONS = [
    [{"role": "user", "content": "hi?"}, {"role": "assistant", "content": "hello"}],
    [{"role": "system", "content": "terse"}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
     {"role": "assistant", "content": "six"}],
    [{"role": "user", "content": "name?"}, {"role": "assistant", "content": "jtrain"}],
]


def _write(path, conversations):
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return str(path)


def _cfg(path, packing="none", seq_len=128, template=chat.TEMPLATE):
    return ml_collections.ConfigDict({
        "path": path, "tokenizer": "", "chat_template": template, "packing": packing,
        "seq_len": seq_len, "val_fraction": 0.0, "split_seed": 0, "packing_buffer": 64})


def _answer_bytes(conversation) -> np.ndarray:
    """By hand: 1 on every byte of an assistant's content and the end tag after it, found
    in the rendered text by position, 0 elsewhere."""
    text = chat.render(conversation)
    mask, at = np.zeros(len(text.encode()), np.float32), 0
    for m in conversation:
        block = f"<|{m['role']}|>\n{m['content']}<|end|>\n"
        start = text.index(block, at)
        if m["role"] == "assistant":
            first = start + len(f"<|{m['role']}|>\n")
            mask[first:first + len(m["content"]) + len("<|end|>\n")] = 1
        at = start + len(block)
    return mask


@pytest.mark.parametrize("packing", ["none", "first_fit"])
def test_the_loss_falls_on_assistant_tokens_only(tmp_path, packing):
    train, val, info = chat.make_chat(_cfg(_write(tmp_path / "c.jsonl", CONVERSATIONS),
                                           packing))
    assert val is None and info["vocab_size"] == 256
    assert len(train) == (3 if packing == "none" else 2)  # first_fit: two share a window
    batch = {k: np.stack([train[i][k] for i in range(len(train))]) for k in train[0]}
    # Each conversation's bytes, inputs and targets shifted by one, within its segment.
    want = {k: np.zeros_like(batch["weights"]) for k in ("weights", "inputs", "targets")}
    for row in range(len(train)):
        for seg in range(1, batch["segment_ids"][row].max() + 1):
            where = np.flatnonzero(batch["segment_ids"][row] == seg)
            text = bytes(batch["inputs"][row, where].astype(np.uint8)).decode() + \
                chr(batch["targets"][row, where[-1]])
            conversation = next(c for c in CONVERSATIONS if chat.render(c) == text)
            want["weights"][row, where] = _answer_bytes(conversation)[1:]
    assert want["weights"].sum() == sum(len(m["content"]) + len("<|end|>\n")
                                        for c in CONVERSATIONS for m in c
                                        if m["role"] == "assistant")
    np.testing.assert_array_equal(batch["weights"], want["weights"])
    if packing == "none":
        return  # the loss over the packed windows, once (a CPU second of compiling)
    logits = np.random.default_rng(0).normal(size=batch["inputs"].shape + (256,))
    loss_sum, weight = jax.jit(losses.default_loss)(jnp.asarray(logits, jnp.float32),
                                           {k: jnp.asarray(v) for k, v in batch.items()})
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    np.testing.assert_allclose(float(loss_sum), (nll * want["weights"]).sum(), rtol=1e-5)
    assert float(weight) == want["weights"].sum()


def test_a_template_is_substituted_as_text_never_formatted():
    messages = [{"role": "user", "content": "{role} {0.__class__}"},
                {"role": "assistant", "content": "ok"}]
    assert chat.render(messages, "[{role}]{content};", prompt=True) == \
        "[user]{role} {0.__class__};[assistant]ok;[assistant]"
    with pytest.raises(DataError, match="data.chat_template.*needs"):
        chat.split_template("{content} {role}")


@pytest.mark.parametrize("line, why", [
    ("{not json", "c.jsonl:2: not JSON"),
    ('{"text": "x"}', "c.jsonl:2: no 'messages' field"),
    ('{"messages": [{"role": "user", "content": 3}]}', "c.jsonl:2: messages\\[0\\] must"),
    ('{"messages": [{"role": "user", "content": "q"}]}', "c.jsonl:2: no assistant"),
])
def test_a_malformed_line_is_one_error_naming_file_and_line(tmp_path, line, why):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n" + line + "\n")
    with pytest.raises(DataError, match=why):
        chat.make_chat(_cfg(str(path)))


def test_sft_from_the_command_line_and_a_bad_line(tmp_path):
    _write(tmp_path / "chat.jsonl", CONVERSATIONS * 4)
    args = ["-m", "jtrain.main", "--config=base:debug", "--workdir=runs/sft",
            "--config.data.name=chat", "--config.data.path=chat.jsonl",
            "--config.data.packing=concat", "--config.data.seq_len=32",
            "--config.model.max_len=32", "--config.model.d_model=16",
            "--config.model.num_layers=1", "--config.data.batch_size=4",
            "--config.total_steps=2", "--config.eval.every_steps=2",
            "--config.data.val_fraction=0.25"]
    proc = run_python(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "runs/sft/summary.json").read_text())
    assert summary["step"] == 2 and np.isfinite(summary["eval/loss"])
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": CONVERSATIONS[0]})
                                        + "\n[1, 2\n")
    proc = run_python(tmp_path, *[a for a in args if "path=" not in a and "workdir" not in a],
                      "--workdir=runs/bad", "--config.data.path=bad.jsonl")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == \
        "jtrain: data error: bad.jsonl:2: not JSON (Expecting ',' delimiter)", proc.stderr


def test_a_tokenizer_file_encodes_each_piece_so_weights_stay_on_the_answers(tmp_path):
    import tokenizers

    from jtrain.data import tokenizer as tokenizer_lib

    texts = [chat.render(c) for c in CONVERSATIONS] * 5
    tok = tokenizer_lib.train("bpe", 300, texts, str(tmp_path / "tokenizer.json"))
    cfg = _cfg(_write(tmp_path / "c.jsonl", CONVERSATIONS))
    cfg.tokenizer = str(tmp_path / "tokenizer.json")
    train, _, info = chat.make_chat(cfg)
    assert info["vocab_size"] == tok.vocab_size and not info["byte_level"]
    decoder = tokenizers.Tokenizer.from_file(cfg.tokenizer)
    for i, conversation in enumerate(CONVERSATIONS):
        item = train[i]
        n = int((item["segment_ids"] > 0).sum())
        answers = "".join(m["content"] + "<|end|>\n" for m in conversation
                          if m["role"] == "assistant")
        trained = [int(t) for t, w in zip(item["targets"][:n], item["weights"][:n],
                                          strict=True) if w]
        assert decoder.decode(trained) == answers  # the answers' tokens, nothing else


@pytest.mark.slow
def test_chat_data_trains_with_lora_and_with_a_population(tmp_path):
    import jtrain

    path = _write(tmp_path / "c.jsonl", CONVERSATIONS * 4)
    for name, extra in (("lora", {"finetune": {"lora": {"rank": 2}}}),
                        ("population", {"population": {"size": 2}})):
        cfg = {"total_steps": 3, "log": {"verbosity": 0}, "eval": {"every_steps": 3},
               "model": {"d_model": 16, "num_layers": 1, "num_heads": 2, "d_ff": 32,
                         "max_len": 32},
               "data": {"name": "chat", "path": path, "packing": "concat", "seq_len": 32,
                        "batch_size": 4, "val_fraction": 0.25}, **extra}
        result = jtrain.train(cfg, str(tmp_path / name))
        assert result.summary["step"] == 3 and result.summary["skipped_steps"] == 0, name
        losses_ = [v for k, v in result.summary.items() if k.endswith("eval/loss")]
        assert losses_ and all(np.isfinite(v) for v in losses_), result.summary
    mixture = {**cfg["data"], "mixture": {"a": {"source": "chat", "weight": 1.0}}}
    with pytest.raises(DataError, match="data.mixture.a.source: 'chat' is neither"):
        jtrain.train({**cfg, "data": mixture, "population": {"size": 1}},
                     str(tmp_path / "mix"))
