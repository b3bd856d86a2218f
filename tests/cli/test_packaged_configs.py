"""`--config=NAME[:variant]` names a config shipped inside the package (jtrain/configs/,
the checkout's configs/ being the same folder); a path to a file is that file, as before.
The installed wheel running them from any directory: tests/journeys/test_wheel_install.py."""

import os
from pathlib import Path

import pytest
from absl import flags
from ml_collections import config_flags

from jtrain import errors
from jtrain.cli import runner

REPO = Path(__file__).resolve().parents[2]


def test_the_checkout_configs_folder_is_the_packaged_one():
    assert os.path.samefile(REPO / "configs", runner.CONFIGS)
    assert os.path.samefile(REPO / "configs" / "recipes" / "classify.py",
                            Path(runner.CONFIGS) / "recipes" / "classify.py")


def test_packaged_configs_are_named_by_their_path_without_py():
    names = runner.packaged_configs()
    assert {"base", "gpt2_small", "tune", "recipes/classify", "recipes/finetune"} <= set(names)
    assert all(not n.endswith(".py") and "\\" not in n for n in names)


@pytest.mark.parametrize("value, packaged", [
    ("base", "base.py"), ("base:debug", "base.py:debug"),
    ("recipes/classify:debug", os.path.join("recipes", "classify.py") + ":debug"),
])
def test_a_name_becomes_the_packaged_file(value, packaged, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert runner.packaged_config(value) == os.path.join(runner.CONFIGS, packaged)


@pytest.mark.parametrize("value", [
    "configs/base.py:debug", "base.py", "nope", "nope:debug", "../configs/base",
    "/abs/base", "recipes/", "",
])
def test_paths_and_unknown_names_are_left_as_given(value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert runner.packaged_config(value) == value


def test_a_file_of_that_name_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "base").write_text("def get_config():\n    return {}\n")
    assert runner.packaged_config("base:debug") == "base:debug"


def _define(fv, argv):
    config_flags.DEFINE_config_file("config", None, "", lock_config=True, flag_values=fv,
                                    sys_argv=["prog", *argv])


@pytest.mark.parametrize("argv", [
    ["--config=base:debug", "--config.total_steps=3"],
    ["--config", "base:debug", "--config.total_steps=3"],
])
def test_both_flag_forms_load_the_packaged_config_with_overrides(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fv = flags.FlagValues()
    _define(fv, argv)
    runner.parse_into(fv, "prog", argv)
    assert fv.config.total_steps == 3 and fv.config.model.d_model == 64  # debug's width


def test_an_unknown_name_is_one_line_listing_the_packaged_configs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fv = flags.FlagValues()
    _define(fv, ["--config=bsae:debug"])
    with pytest.raises(errors.ConfigError) as e:
        runner.parse_into(fv, "prog", ["--config=bsae:debug"])
    line = errors.render(e.value)
    assert line.startswith("jtrain: config error: bsae: no such file, nor a packaged config "
                           "(one of: base, "), line
    assert "recipes/classify" in line and "\n" not in line


def test_an_error_in_a_packaged_config_names_it_as_typed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fv = flags.FlagValues()
    _define(fv, ["--config=base:typo"])
    with pytest.raises(errors.ConfigError) as e:
        runner.parse_into(fv, "prog", ["--config=base:typo"])
    assert errors.render(e.value) == ("jtrain: config error: base: configs/base.py: unknown "
                                      "variant 'typo'; choose one of: debug")
