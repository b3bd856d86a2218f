"""A population as its users meet it: the CLI with their own Linen model
(model.factory) and `population.size=4` varying optim.lr and optim.weight_decay, under
`--verify_resume` (killed once and restarted, bitwise identical; population.png
written); then `python -m jtrain.export --member=2` on that run. (jtrain.evaluate's
refusal of a whole population: tests/engine/test_population.py.)"""

import json

from journey import copy_project, run_python

CONFIG = '''
"""python -m jtrain.main --config=cfg.py --workdir=runs/pop"""
from jtrain.config import defaults


def get_config():
    c = defaults(model="user")
    c.update({"model": {"factory": "linen_classifier:Net"},
              "data": {"source": "mydata:make", "batch_size": 8},
              "total_steps": 4, "optim": {"lr": 0.05}, "eval": {"every_steps": 2},
              # async_save off: one kill always resumes from a step between 0 and 4
              "checkpoint": {"every_steps": 1, "async_save": False},
              "log": {"every_steps": 2},
              "population": {"size": 4,
                             "vary": {"optim": {"lr": [0.01, 0.02, 0.05, 0.1],
                                                "weight_decay": [0.0, 0.0, 0.1, 0.3]}}}})
    return c
'''


def test_cli_population_resumes_bitwise_and_exports_a_member(tmp_path):
    copy_project(tmp_path, "linen_classifier", "mydata")
    (tmp_path / "cfg.py").write_text(CONFIG)
    proc = run_python(tmp_path, "-m", "jtrain.main", "--config=cfg.py",
                      "--workdir=runs/pop", "--verify_resume", "--verify_kills=1")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "verify_resume: PASS: bitwise identical" in out, out[-3000:]
    run = tmp_path / "runs" / "pop" / "reference"
    assert "jtrain: population: 4 members in one compiled step" in (run / "train.log").read_text()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("train/loss/m3" in r for r in records)
    assert any("eval/loss/m3" in r for r in records)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["population"]["lrs"] == [0.01, 0.02, 0.05, 0.1]
    assert summary["population"]["weight_decays"] == [0.0, 0.0, 0.1, 0.3]
    assert (run / "population.png").exists()

    proc = run_python(tmp_path, "-m", "jtrain.export", "runs/pop/reference", "--out=m2",
                      "--member=2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "exported step 4 of member 2" in proc.stdout
    record = json.loads((tmp_path / "m2" / "export.json").read_text())
    assert record["config"]["optim"]["lr"] == 0.05 and record["config"]["seed"] == 2
    assert record["config"]["optim"]["weight_decay"] == 0.1
