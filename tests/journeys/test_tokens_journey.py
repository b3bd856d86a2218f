"""docs/guide/language-models.md as its reader runs it: text files of their own
tokenized once (`jtrain tokenize`, a BPE tokenizer trained on them), a tiny model trained
on the shards from the command line, the same run killed and resumed bitwise identical
(--verify_resume), the Hugging Face export tokenizing as the shards were made, and
`jtrain sample` speaking the run's tokenizer: greedy equal to transformers' generate on
the export token for token, the text equal to what AutoTokenizer decodes."""

import json
import os
import re
import shlex
from pathlib import Path

import pytest

import jtrain
from jtrain import errors

from journey import run_python

PAGE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "language-models.md"
MARK = "<!-- tested: tests/journeys/test_tokens_journey.py -->"


def page_commands() -> list[list[str]]:
    """The page's bash blocks this test runs, each as argv after `python`."""
    blocks = re.findall(re.escape(MARK) + r"\n```bash\n(.*?)```", PAGE.read_text(), re.S)
    commands = [shlex.split(b.replace("\\\n", " ")) for b in blocks]
    assert commands and all(c[0] == "python" for c in commands), commands
    return [c[1:] for c in commands]


def made_with(cwd) -> str:
    return json.loads((cwd / "shards" / "index.json").read_text())["tokenizer"]["fingerprint"]


def test_the_language_model_page_runs_as_written(tmp_path):
    (tmp_path / "notes.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 60)
    (tmp_path / "posts.jsonl").write_text("".join(
        json.dumps({"body": f"post {i}: tokens once, windows many times"}) + "\n"
        for i in range(80)))
    tokenize, train, verify, export, sample = page_commands()
    proc = run_python(tmp_path, *tokenize)
    assert proc.returncode == 0, proc.stderr[-2000:]
    made = json.loads(proc.stdout.strip().splitlines()[-1])
    assert made["num_documents"] == 81 and made["vocab_size"] <= 300

    proc = run_python(tmp_path, *train)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "lm"
    assert (run / "tokenizer.json").read_bytes() == (tmp_path / "shards" /
                                                     "tokenizer.json").read_bytes()
    cfg = json.loads((run / "config.json").read_text())["data"]
    assert cfg["name"] == "tokens" and cfg["path"] == "shards"
    assert cfg["tokenizer"] == f"tokenizer.json (sha256 {made_with(tmp_path)})"
    log = (run / "train.log").read_text().splitlines()
    assert any("token shards sha256" in ln for ln in log)
    ended = [ln[ln.index("jtrain: sample: "):] for ln in log  # base:debug's prompts
             if "jtrain: sample: " in ln]

    proc = run_python(tmp_path, *verify)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("jtrain: verify_resume:")]
    assert proc.returncode == 0 and len(lines) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert lines[0].startswith("jtrain: verify_resume: PASS: bitwise identical"), lines[0]

    proc = run_python(tmp_path, *export)
    assert proc.returncode == 0 and "tokenizer: tokenizer.json" in proc.stdout, proc.stderr
    import tokenizers
    import transformers

    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "exports" / "lm"))
    ours = tokenizers.Tokenizer.from_file(str(tmp_path / "shards" / "tokenizer.json"))
    text = "post 7: the quick brown fox, tokens once"
    assert auto(text)["input_ids"] == ours.encode(text).ids

    proc = run_python(tmp_path, *sample)
    assert proc.returncode == 0, proc.stderr[-2000:]
    prompts = [sample[i + 1] for i, a in enumerate(sample) if a == "--prompt"]
    os.chdir(tmp_path)  # the library as the reader calls it, from the same directory
    out = jtrain.sample("runs/lm", prompts, max_new_tokens=12)
    first = ["def ", "import ", "class "]  # the run's end: its tokenizer, final params
    want = jtrain.sample("runs/lm", first, max_new_tokens=24)
    assert ended == [f"jtrain: sample: {p!r} -> {s.text!r}"
                     for p, s in zip(first, want, strict=True)]
    assert proc.stdout == "\n".join(p + s.text + "\n" for p, s in zip(prompts, out, strict=True))
    assert "2 prompt(s), 24 tokens" in proc.stderr
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exports" / "lm"))
    for prompt, got in zip(prompts, out, strict=True):
        ids = auto(prompt, return_tensors="pt")["input_ids"]
        assert ids[0].tolist() == ours.encode(prompt).ids
        theirs = hf.generate(ids, attention_mask=ids * 0 + 1, do_sample=False,
                             max_new_tokens=12, pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert got.tokens == theirs and got.text == auto.decode(theirs)
    # A stop string is found in the decoded text and cut with the tokens reaching into it.
    stop = out[0].text[len(out[0].text) // 2:][:2]
    cut = jtrain.sample("runs/lm", prompts[0], max_new_tokens=12, stop=[stop])[0]
    assert cut.finish == "stop" and cut.text == out[0].text[:out[0].text.index(stop)]
    assert cut.tokens == out[0].tokens[:len(cut.tokens)] and len(cut.tokens) < 12

    class Wide:  # a tokenizer whose vocabulary the model cannot emit
        vocab_size = 4096
    with pytest.raises(errors.UsageError, match="vocab size 4096 is larger than the "
                       "model's .320."):
        jtrain.sample("runs/lm", prompts, tokenizer=Wide())
    with open(tmp_path / "runs" / "lm" / "tokenizer.json", "a") as f:
        f.write(" ")
    proc = run_python(tmp_path, *sample)
    assert proc.returncode != 0 and proc.stderr.strip().splitlines() == [
        f"jtrain: usage error: RUN: runs/lm: tokenizer.json is missing or changed: not the "
        f"tokenizer config.json names (tokenizer.json (sha256 {made_with(tmp_path)}))"], \
        proc.stderr
