"""The generated reference (docs/reference/: config keys, exit codes, command flags, metric
names) is what `python -m jtrain.reference --write docs/reference` writes, and the metric
names list (jtrain.metrics.names) holds every name a run writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from absl import flags

from jtrain import reference
from jtrain.metrics import names
from journey import user_env

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "reference"


def test_generated_reference_pages_are_up_to_date():
    assert reference.stale(str(DOCS)) == [], (
        "docs/reference is stale: python -m jtrain.reference --write docs/reference")


def test_check_names_a_stale_page(tmp_path):
    for name, text in reference.pages().items():
        (tmp_path / name).write_text(text)
    (tmp_path / "commands.md").write_text("# Command-line flags\n")
    proc = subprocess.run([sys.executable, "-m", "jtrain.reference", "--check", str(tmp_path)],
                          env=user_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "commands.md" in proc.stderr and "config.md" not in proc.stderr


def test_commands_page_has_every_flag_of_every_command():
    text = reference.commands_markdown()
    commands = reference._commands()
    assert {p for p, _, _ in commands} >= {
        "python -m jtrain.main", "python -m jtrain.evaluate", "python -m jtrain.export",
        "python -m jtrain.tune", "python -m jtrain.bench overhead"}
    for prog, _, define in commands:
        fv = flags.FlagValues()
        define(fv)
        section = text.split(f"## `{prog}`\n", 1)[1].split("\n## ", 1)[0]
        for name in fv:
            assert f"| `--{fv[name].name}` |" in section, (prog, name)


def test_names_match_families_only_where_listed():
    assert names.listed("train/loss") and names.listed("eval/top_5_accuracy")
    assert names.listed("eval/precision/3") and names.listed("startup/imports_sec")
    assert not names.listed("train/recon")  # a loss term only when the loss names it
    assert names.listed("train/recon", terms=("recon",))
    assert not names.listed("perf/unknown") and not names.listed("eval/top_k_accuracy")


def test_a_run_writes_only_listed_metric_names(tmp_path):
    import jtrain

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 6)).astype(np.float32)
    y = (np.argmax(x[:, :3], 1)).astype(np.int32)
    config = {"model": {"name": "mlp", "hidden": (16,), "num_outputs": 3},
              "total_steps": 12, "data": {"batch_size": 32},
              "eval": {"every_steps": 6, "top_k": 2,
                       "metrics": ("loss", "accuracy", "top_k_accuracy",
                                   "precision_recall_f1", "confusion_matrix", "auroc")},
              "log": {"every_steps": 4, "verbosity": 0}}
    workdir = tmp_path / "run"
    jtrain.train(config, str(workdir), train_data=(x[:192], y[:192]),
                 eval_data=(x[192:], y[192:]))
    written = set()
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        written |= set(json.loads(line))
    written |= set(json.loads((workdir / "summary.json").read_text()))
    namespaced = {k for k in written if "/" in k}
    assert {"train/loss", "train/lr", "eval/accuracy", "eval/top_2_accuracy",
            "perf/steps_per_sec", "compile/count"} <= namespaced
    assert sorted(k for k in namespaced if not names.listed(k)) == [], \
        "add these to jtrain/metrics/names.py"
    from jtrain.observe import layout

    unlisted = sorted(p.name for p in workdir.iterdir() if not layout.listed(p.name))
    assert unlisted == [], "add these to jtrain/observe/layout.py"
    assert not layout.listed("notes.txt")
