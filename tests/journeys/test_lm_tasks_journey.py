"""eval.lm_tasks from the command line, in an empty directory: the guide's config file
(docs/guide/language-models.md) names a choice task and a perplexity task by relative
paths; a malformed line of the choice file is one line naming the file and the line,
exit 2, no step run; the fixed file trains,
metrics.jsonl carries eval/<task>/acc, acc_norm and ppl, and early stopping watches
eval/ch/acc."""

import json
import re
from pathlib import Path

import pytest
from journey import run_python

GUIDE = Path(__file__).parents[2] / "docs" / "guide" / "language-models.md"
# the guide's config file, as a reader pastes it
CONFIG = re.search(r"```python\n# file: cfg.py\n(.*?)```", GUIDE.read_text(), re.S).group(1)
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
