"""eval.lm_tasks from the command line, in an empty directory: a config file names a
choice task and a perplexity task by relative paths; a malformed line of the choice file
is one line naming the file and the line, exit 2, no step run; the fixed file trains,
metrics.jsonl carries eval/<task>/acc, acc_norm and ppl, and early stopping watches
eval/ch/acc."""

import json

import pytest
from journey import run_python

CONFIG = '''
from jtrain.config import defaults

def get_config():
    c = defaults()
    c.model.update(d_model=16, num_layers=1, num_heads=2, d_ff=32, max_len=16)
    c.data.update(seq_len=16, batch_size=4)
    c.total_steps = 2
    c.eval.update(every_steps=2, num_batches=1, lm_tasks={
        "ch": {"kind": "choice", "path": "choice.jsonl"},
        "held": {"kind": "perplexity", "path": "held.txt"}})
    c.early_stop.update(monitor="eval/ch/acc", mode="max", patience=3)
    return c
'''
GOOD = {"context": "import ", "choices": ["os", "zz"], "label": 0}


@pytest.mark.slow
def test_lm_tasks_from_the_command_line(tmp_path):
    (tmp_path / "cfg.py").write_text(CONFIG)
    (tmp_path / "held.txt").write_text("import os\nimport sys\n" * 3)
    (tmp_path / "choice.jsonl").write_text(json.dumps(GOOD) + '\n{"context": "a"}\n')
    args = ("-m", "jtrain.main", "--config=cfg.py", "--workdir=run")
    bad = run_python(tmp_path, *args)
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert bad.stderr.strip().splitlines()[-1] == (
        'jtrain: data error: choice.jsonl:2: want {"context": str, "choices": '
        '[2 or more non-empty str], "label": index of the answer}')
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

    (tmp_path / "choice.jsonl").write_text(json.dumps(GOOD) + "\n")
    good = run_python(tmp_path, *args)
    assert good.returncode == 0, good.stderr[-2000:]
    records = [json.loads(line) for line in
               (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/ch/acc" in r]
    assert len(evals) == 1 and evals[0]["step"] == 2
    assert evals[0]["eval/ch/acc"] in (0.0, 1.0) and evals[0]["eval/held/ppl"] > 1
    assert "eval/ch/acc_norm" in evals[0]
