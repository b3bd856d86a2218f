"""Run forensics as a user meets it, from the CLI in a temp cwd with their own Linen
model (model.factory) and data module: a run trained straight through and the same
command SIGKILLed after step 5 and rerun (resumed from its last finished checkpoint) record
identical hashes.jsonl; `jtrain diff` says identical (exit 0, one JSON line); `jtrain replay
--step 5` reproduces the step bitwise from the checkpoint before it."""

import json

from journey import copy_project, run_python

CONFIG = '''
from jtrain.config import defaults


def get_config():
    c = defaults(model="user")
    c.model.factory = "linen_classifier:Net"
    c.seed = 0
    c.total_steps = 8
    c.data.source = "mydata:make"
    c.data.kwargs = {"n": 48, "train": None}  # all 48 rows train
    c.data.batch_size = 8
    c.eval.every_steps = 0
    c.checkpoint.every_steps = 2
    c.log.writers = ("jsonl",)
    c.debug.hash_every_steps = 1
    return c
'''


def test_kill_resume_diff_and_replay_from_the_cli(tmp_path):
    copy_project(tmp_path, "linen_classifier")
    (tmp_path / "cfg.py").write_text(CONFIG)
    copy_project(tmp_path, "mydata")
    train = ["-m", "jtrain.main", "--config=cfg.py"]
    assert run_python(tmp_path, *train, "--workdir=runs/a").returncode == 0
    killed = run_python(tmp_path, *train, "--workdir=runs/b", JTRAIN_FAULT="step:5")
    assert killed.returncode == -9, killed.stderr[-2000:]
    again = run_python(tmp_path, *train, "--workdir=runs/b")
    assert again.returncode == 0 and "resumed from step " in again.stdout + again.stderr
    hashes = [(tmp_path / f"runs/{r}/hashes.jsonl").read_text() for r in "ab"]
    assert hashes[0] == hashes[1] and len(hashes[0].splitlines()) == 8

    diff = run_python(tmp_path, "-m", "jtrain.diff", "runs/a", "runs/b")
    assert diff.returncode == 0, diff.stderr[-2000:]
    assert json.loads(diff.stdout)["identical"] is True
    assert "jtrain: diff: identical (8 recorded state hashes equal)" in diff.stderr

    replay = run_python(tmp_path, "-m", "jtrain.replay", "runs/b", "--step=5")
    assert replay.returncode == 0, replay.stderr[-2000:]
    out = json.loads(replay.stdout)
    assert out["reproduced"] and out["from_step"] == 4 and out["examples_match"]
    assert "step 5 reproduced bitwise" in replay.stderr

