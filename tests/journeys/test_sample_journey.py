"""The sampling journey (docs/guide/language-models.md): a byte-level run of the built-in
transformer, then `python -m jtrain sample RUN --prompt hi` from a temp directory prints
the prompt and what the library's `jtrain.sample` continues it with; a prompt past the
context, a step that is not saved and a run naming code that is not trusted are one line
each, the last before anything is imported; so is a run whose state is not one model's
parameters (a population, LoRA adapters, a step of your own)."""

import json
import shutil
import sys

import pytest

import jtrain
from jtrain import cli, errors

from journey import run_python


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("sample")
    cfg = jtrain.defaults("transformer")
    cfg.total_steps = 2
    cfg.model.update(d_model=32, num_layers=2, num_heads=4, d_ff=64, max_len=32)
    cfg.data.update(name="pystdlib", seq_len=32, batch_size=8)
    cfg.eval.every_steps = 0
    cfg.log.verbosity = 0
    jtrain.train(cfg, str(cwd / "run"))
    return cwd


def test_sample_a_run_from_the_command_line(run):
    proc = run_python(run, "-m", "jtrain", "sample", "run", "--prompt", "hi",
                      "--max_new_tokens", "8")
    assert proc.returncode == 0, proc.stderr
    want = jtrain.sample(str(run / "run"), "hi", max_new_tokens=8)[0]
    assert proc.stdout == "hi" + want.text + "\n"
    assert "1 prompt(s), 8 tokens" in proc.stderr and "finish: length" in proc.stderr


def test_bad_input_is_one_line(run, capsys, monkeypatch):
    monkeypatch.chdir(run)
    for argv, line in (
            (["run", "--prompt", "x" * 33], "jtrain: usage error: --prompt: 33 tokens, the "
             "model's context is 32"),
            (["run", "--prompt", "x", "--step", "1"], "jtrain: usage error: --step: "),
            (["run", "--prompt", "x", "--top_p", "0"], "jtrain: usage error: --top_p: "
             "must be in (0, 1]"),
            (["nowhere", "--prompt", "x"], "jtrain: usage error: RUN: nowhere is not a "
             "directory")):
        assert cli.main(["sample", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(line), err


def test_a_run_naming_untrusted_code_is_refused_before_it_is_imported(run, capsys):
    other = run / "other"
    shutil.copytree(run / "run", other)
    config = json.loads((other / "config.json").read_text())
    config["model"] = {**config["model"], "name": "user", "factory": "planted_mod:make"}
    (other / "config.json").write_text(json.dumps(config))
    (run / "planted_mod.py").write_text("raise SystemExit('imported')\n")
    sys.path.insert(0, str(run))
    try:
        with pytest.raises(errors.WorkdirError) as e:
            jtrain.sample(str(other), "hi")
    finally:
        sys.path.remove(str(run))
    assert "planted_mod" not in sys.modules
    assert errors.render(e.value).endswith(f"if you trust it: jtrain trust {other}")
    config["model"] = json.loads((run / "run" / "config.json").read_text())["model"]
    config["loss"]["fn"] = "planted_mod:loss"  # named, never imported: sampling needs
    (other / "config.json").write_text(json.dumps(config))  # the built-in model alone
    sys.path.insert(0, str(run))
    try:
        assert jtrain.sample(str(other), "hi", max_new_tokens=2)[0].finish == "length"
    finally:
        sys.path.remove(str(run))
    assert "planted_mod" not in sys.modules


def test_a_checkpoint_that_is_not_the_configs_model_is_one_line(run):
    other = run / "wider"
    shutil.copytree(run / "run", other)
    config = json.loads((other / "config.json").read_text())
    config["model"]["d_model"] = 64
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(errors.UsageError) as e:
        jtrain.sample(str(other), "hi")
    assert errors.render(e.value) == (f"jtrain: usage error: RUN: {other}: the checkpoint's "
                                      "params are not those of the model its config.json "
                                      "builds")


@pytest.mark.parametrize("section,value,why", [
    ("population", {"size": 2}, "trained a population: export one member"),
    ("finetune", {"lora": {"rank": 2}}, "holds LoRA adapters: merge them"),
    ("step", {"factory": "planted_mod:step"}, "trained a step of your own"),
])
def test_a_run_whose_state_is_not_one_models_params_is_one_line(run, capsys, monkeypatch,
                                                                 section, value, why):
    other = run / section
    shutil.copytree(run / "run", other)
    config = json.loads((other / "config.json").read_text())
    config[section] = {**config[section], **value}
    (other / "config.json").write_text(json.dumps(config))
    monkeypatch.chdir(run)
    assert cli.main(["sample", section, "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"jtrain: usage error: RUN: {section} {why}")
