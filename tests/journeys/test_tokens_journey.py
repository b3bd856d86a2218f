"""docs/guide/language-models.md as its reader runs it: text files of their own
tokenized once (`jtrain tokenize`, a BPE tokenizer trained on them), a tiny model trained
on the shards from the command line, the same run killed and resumed bitwise identical
(--verify_resume), and the Hugging Face export tokenizing as the shards were made."""

import json
import re
import shlex
from pathlib import Path

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
    tokenize, train, verify, export = page_commands()
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
    assert "token shards sha256" in (run / "train.log").read_text()

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
