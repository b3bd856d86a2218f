"""`jtrain tune` over a step of your own's `step.kwargs`: each trial rebuilds the step from
step.factory with its sampled kwargs, and best_config.py carries them (the step module of
docs/guide/own-step.md, as a user saves it)."""

import json
import re
from pathlib import Path

from journey import run_python

PAGE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "own-step.md"


def test_tune_samples_the_steps_kwargs(tmp_path):
    files = dict(re.findall(r"<!-- run -->\n```python\n# file: (\S+)\n(.*?)```",
                            PAGE.read_text(), re.S))
    (tmp_path / "mystep.py").write_text(files["mystep.py"])
    (tmp_path / "cfg.py").write_text(files["cfg.py"].replace("    return config", """\
    config.total_steps = 10
    config.eval.every_steps = 10
    config.tune.space = {"step": {"kwargs": {"lr": ("log_uniform", 0.01, 0.3)}}}
    config.tune.trials = 2
    return config"""))
    proc = run_python(tmp_path, "-m", "jtrain.tune", "--config=cfg.py", "--workdir=runs/t")
    assert proc.returncode == 0, proc.stderr[-3000:]
    trials = [json.loads(line) for line in
              (tmp_path / "runs" / "t" / "trials.jsonl").read_text().splitlines()]
    lrs = [t["params"]["step.kwargs.lr"] for t in trials if t["state"] == "complete"]
    assert len(lrs) == 2 and lrs[0] != lrs[1] and all(0.01 <= lr <= 0.3 for lr in lrs)
    for t in trials:  # each trial's run recorded the kwargs it was built with
        run = json.loads((tmp_path / "runs" / "t" / t["workdir"] / "config.json").read_text())
        assert run["step"]["kwargs"]["lr"] == t["params"]["step.kwargs.lr"]
    best = (tmp_path / "runs" / "t" / "best_config.py").read_text()
    assert "mystep:make" in best
