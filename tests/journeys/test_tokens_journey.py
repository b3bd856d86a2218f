"""A user tokenizes their own text files once (`jtrain tokenize`, a BPE tokenizer trained
on them), trains a tiny model on the shards from the command line, killed and resumed
bitwise identical (--verify_resume); the run keeps the tokenizer, and its Hugging Face
export tokenizes as the shards were made."""

import json

from journey import run_python

TRAIN = ["-m", "jtrain.main", "--config=base:debug", "--config.data.name=tokens",
         "--config.data.path=shards", "--config.data.seq_len=16", "--config.model.max_len=16",
         "--config.data.batch_size=4", "--config.model.d_model=16",
         "--config.model.num_layers=1", "--config.model.vocab_size=320",
         "--config.total_steps=4", "--config.eval.every_steps=2",
         "--config.checkpoint.every_steps=1", "--config.checkpoint.async_save=False"]


def test_tokenize_train_resume_and_export(tmp_path):
    (tmp_path / "notes.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 60)
    (tmp_path / "posts.jsonl").write_text("".join(
        json.dumps({"body": f"post {i}: tokens once, windows many times"}) + "\n"
        for i in range(80)))
    proc = run_python(tmp_path, "-m", "jtrain", "tokenize", "--input=notes.txt,*.jsonl",
                      "--out=shards", "--tokenizer=bpe:300", "--text_field=body")
    assert proc.returncode == 0, proc.stderr[-2000:]
    made = json.loads(proc.stdout.strip().splitlines()[-1])
    assert made["num_documents"] == 81 and made["vocab_size"] <= 300

    proc = run_python(tmp_path, *TRAIN, "--workdir=runs/lm", "--verify_resume",
                      "--verify_kills=1")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("jtrain: verify_resume:")]
    assert proc.returncode == 0 and len(lines) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert lines[0].startswith("jtrain: verify_resume: PASS: bitwise identical"), lines[0]
    run = tmp_path / "runs" / "lm" / "reference"
    assert (run / "tokenizer.json").read_bytes() == (tmp_path / "shards" /
                                                     "tokenizer.json").read_bytes()
    cfg = json.loads((run / "config.json").read_text())["data"]
    assert cfg["name"] == "tokens" and cfg["path"] == "shards"
    assert "token shards sha256" in (run / "train.log").read_text()

    from jtrain.checkpoint import hf_export

    record = hf_export.export(str(run), str(tmp_path / "hf"))
    assert record["hf"]["tokenizer"] == "tokenizer.json"
    import tokenizers
    import transformers

    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ours = tokenizers.Tokenizer.from_file(str(tmp_path / "shards" / "tokenizer.json"))
    text = "post 7: the quick brown fox, tokens once"
    assert auto(text)["input_ids"] == ours.encode(text).ids
