"""Renamed keys (docs/compatibility.md): an old name is read as the new one with one note
line, a run directory's config.json of an older release resolves to what the new names
give, and the schema's docs name only modules and files that exist."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

import jtrain
from jtrain import config as config_lib
from jtrain.config import renamed, sections

REPO = Path(__file__).resolve().parents[2]
OLD_RUN = REPO / "tests" / "fixtures" / "run_v1" / "config.json"  # written by 0.1.0


def test_old_names_are_read_as_the_new_ones_with_one_note():
    old = {"deterministic": True,
           "optim": {"name": "muon", "muon_beta": 0.8, "muon_ns_steps": 3,
                     "momentum": 0.5, "prodigy_d0": 1e-3},  # the last two: not muon's
           "checkpoint": {"init_from": "runs/a", "init_from_step": "best",
                          "init_exclude": ["head"], "writer_nice": 5},
           "eval": {"async_nice": 0}, "population": {"data": "shared"}}
    cfg, notes = config_lib.resolve_for_run(old)
    assert cfg.determinism.gpu_ops is True
    assert cfg.optim.kwargs.to_dict() == {"beta": 0.8, "ns_steps": 3}
    assert (cfg.init.path, cfg.init.step, tuple(cfg.init.exclude)) == ("runs/a", "best",
                                                                         ("head",))
    assert "writer_nice" not in cfg.checkpoint and "async_nice" not in cfg.eval
    assert "data" not in cfg.population
    assert len(notes) == 1 and "\n" not in notes[0], notes
    for pair in ("optim.muon_beta -> optim.kwargs.beta", "checkpoint.init_from -> init.path",
                 "deterministic -> determinism.gpu_ops",
                 "checkpoint.writer_nice -> $JTRAIN_WRITER_NICE"):
        assert pair in notes[0], notes[0]
    assert config_lib.resolve(old).to_dict() == cfg.to_dict()  # resolve alone maps too
    assert old["optim"]["muon_beta"] == 0.8  # the caller's dict is left as it was


def test_the_new_names_give_no_note():
    _, notes = config_lib.resolve_for_run({"optim": {"name": "sgd",
                                                     "kwargs": {"momentum": 0.5}}})
    assert notes == []


def test_an_old_run_config_resolves_to_what_the_new_names_give():
    saved = json.loads(OLD_RUN.read_text())
    assert "muon_beta" in saved["optim"] and "init_from" in saved["checkpoint"]
    old = config_lib.resolve(saved).to_dict()
    new, note = renamed.apply(saved)
    assert note is not None
    assert not {"muon_beta", "muon_ns_steps", "prodigy_d0", "momentum", "nesterov"} \
        & set(new["optim"])
    assert not [k for k in new["checkpoint"] if k.startswith("init_") or k == "writer_nice"]
    assert "data" not in new["population"] and "deterministic" not in new
    assert old["optim"]["kwargs"] == {} and old["optim"]["name"] == "adamw"
    assert old["init"]["path"] == "" and old["determinism"]["gpu_ops"] is False


def test_an_old_sgd_run_keeps_its_momentum():
    saved = json.loads(OLD_RUN.read_text())
    saved["optim"].update(name="sgd", momentum=0.3, nesterov=True)
    cfg = config_lib.resolve(saved)
    assert cfg.optim.kwargs.to_dict() == {"momentum": 0.3, "nesterov": True}
    fresh = config_lib.resolve({**saved, "optim": {
        **{k: v for k, v in saved["optim"].items()
           if k not in ("momentum", "nesterov", "muon_beta", "muon_ns_steps", "prodigy_d0")},
        "kwargs": {"momentum": 0.3, "nesterov": True}}})
    assert config_lib.config_hash(cfg) == config_lib.config_hash(fresh)


@pytest.mark.parametrize("section, key", [("optim", "muon_beta"), ("checkpoint", "init_map"),
                                          ("population", "data")])
def test_an_old_name_for_one_section_alone_names_the_new_one(section, key):
    with pytest.raises(jtrain.ConfigError) as e:
        sections.section(section, {key: 1}, total_steps=10)
    assert e.value.key == f"{section}.{key}" and e.value.why == renamed.new_name(e.value.key)


def test_key_docs_name_only_modules_and_files_that_exist():
    """The schema's docs and comments: every jtrain.x.y module and every jtrain/... or
    docs/... file they name is there (a key doc renders into docs/reference/config.md)."""
    missing = []
    for path in sorted((REPO / "jtrain" / "config").glob("schema*.py")) + [
            REPO / "jtrain" / "config" / "fields.py"]:
        text = path.read_text()
        for name in re.findall(r"\b(?:jtrain|docs)/[\w/.-]*\.(?:py|md)\b", text):
            if not (REPO / name).exists():
                missing.append(f"{path.name}: {name}")
        for name in set(re.findall(r"\bjtrain(?:\.\w+)+", text)):
            parts = name.split(".")
            found = any(_spec(".".join(parts[:n]))
                        and (n == len(parts) or _has(".".join(parts[:n]), parts[n:]))
                        for n in range(len(parts), 0, -1))
            if not found:
                missing.append(f"{path.name}: {name}")
    assert not missing, missing


def _spec(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name below a plain module
        return False


def _has(module: str, attrs: list[str]) -> bool:
    obj = importlib.import_module(module)
    for attr in attrs:
        if not hasattr(obj, attr):
            return False
        obj = getattr(obj, attr)
    return True


def test_an_old_run_directory_resumes_with_its_saved_config(tmp_path, monkeypatch, capfd):
    """The fixture run (config.json and the checkpoint's record with the old names:
    optim.muon_beta, checkpoint.init_from, deterministic, population.data, ...) resumes
    from its step 2 with none of the renamed keys taken for a change, and its config.json
    is written back with the new names."""
    shutil.copytree(OLD_RUN.parent, tmp_path / "run")
    shutil.copy(REPO / "tests" / "projects" / "nnx_mlp.py", tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    saved = json.loads(OLD_RUN.read_text())
    result = jtrain.train({**saved, "log": {**saved["log"], "verbosity": 1}}, "run")
    assert [r["step"] for r in result.train_history] == [3, 4]
    err = capfd.readouterr().err
    changes = [ln for ln in err.splitlines() if "resuming with config changes" in ln]
    moved = [*renamed.NEW, *(new.split()[0] for new in renamed.NEW.values()
                             if new and not new.startswith("$")), "optim.kwargs."]
    assert changes and not [k for k in moved if f"{k} " in changes[0]], changes
    assert "old key names, read as the new ones" in err
    written = json.loads((tmp_path / "run" / "config.json").read_text())
    assert written["init"]["path"] == "" and "init_from" not in written["checkpoint"]
    assert "muon_beta" not in written["optim"] and "deterministic" not in written
