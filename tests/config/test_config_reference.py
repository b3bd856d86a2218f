"""Config discovery: docs/reference/config.md is what `python -m jtrain.config --markdown` writes
(every key of every section and model family, from the schema), and
`--print_config` prints the resolved config of a config file, every key with its value,
type, default, range or choices and description, exit 0, without a workdir."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from jtrain.config import reference
from jtrain.config.schema import MODEL_FAMILIES, SCHEMA, describe
from journey import user_env

REPO = Path(__file__).resolve().parents[2]


def test_docs_config_md_matches_the_schema():
    on_disk = (REPO / "docs" / "reference" / "config.md").read_text()
    assert on_disk == reference.markdown(), (
        "docs/reference/config.md is stale: python -m jtrain.config --markdown > "
        "docs/reference/config.md")


def test_reference_lists_every_key_with_its_description():
    text = reference.markdown()
    for key, field in describe():
        name = key.split(" [")[0]
        assert f"| `{name}` |" in text, name
        assert field.doc.replace("|", "\\|") in text, key
    for family in MODEL_FAMILIES:
        assert f"model.name={family!r}" in text


def test_print_config_as_a_user_types_it(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "base.py").write_text((REPO / "configs" / "base.py").read_text())
    proc = subprocess.run([sys.executable, "-m", "jtrain.main", "--config=configs/base.py:debug",
                           "--print_config", "--config.optim.lr=0.01",
                           "--config.data.kwargs.log_dir=logs"],
                          cwd=tmp_path, env=user_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    body = [ln for ln in lines if not ln.startswith("#")]
    n_keys = sum(1 for k, _ in describe() if "[" not in k or k.endswith("[transformer]"))
    assert len(body) == n_keys  # every key of the transformer family's config, once
    lr = next(ln for ln in body if ln[2:].startswith("optim.lr ="))
    assert lr.startswith("* optim.lr = 0.01 ") and "default 0.001" in lr and "[0, 10]" in lr
    assert SCHEMA["optim"]["lr"].doc in lr
    heads = next(ln for ln in body if ln[2:].startswith("model.num_heads ="))
    assert SCHEMA["model"]["name"] and "attention heads" in heads  # a model family key
    kwargs = next(ln for ln in body if ln[2:].startswith("data.kwargs ="))
    assert "'log_dir': 'logs'" in kwargs  # a new key in a free-form dict
    assert not (tmp_path / "runs").exists()
