"""The recipes of configs/recipes/ as a user runs them: the CLI in a temp cwd holding a
copy of configs/, relative paths, each recipe at a test size (its :debug variant, fewer
steps), asserting the result each recipe states: imputed Pearson above mean imputation,
pretrained above from-scratch accuracy, early stopping on F1 with the best checkpoint
evaluated, every loss term in the returned history, set completion above the
popularity baseline on 2 processes. Where a recipe's command already ran as a user runs
it, its further runs and reads happen in this process (the fine-tune variants beside
`full` on one shared pretraining run and scratch baseline, jtrain.evaluate, the report's
one-line error)."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from journey import run_python, user_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _user_dir(tmp_path):
    shutil.copytree(os.path.join(REPO, "configs"), tmp_path / "configs")
    return tmp_path


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _summary(cwd, run):
    with open(os.path.join(cwd, run, "summary.json")) as f:
        return json.load(f)


def test_imputation_beats_mean_imputation(tmp_path, monkeypatch, capsys):
    cwd = _user_dir(tmp_path)
    out = _ok(run_python(cwd, "-m", "jtrain.main", "--config=configs/recipes/imputation.py:debug",
                         "--workdir=runs/imp", "--config.total_steps=150",
                         "--config.eval.every_steps=150"))
    assert "recipe imputation:" in out and "IterableDataset" in out
    summary = _summary(cwd, "runs/imp")
    for term in ("counts_imputed", "counts_observed", "pvals_imputed", "pvals_observed",
                 "r2", "pearson", "spearman", "mse"):
        assert f"eval/{term}" in summary, term
    report = _ok(run_python(cwd, "-m", "jtrain.recipes.report", "runs/imp"))
    m = re.search(r"imputed-feature Pearson ([\d.]+) vs mean-imputation baseline ([\d.]+) "
                  r"\(above the baseline\)", report)
    assert m, report
    assert float(m.group(1)) > float(m.group(2)) + 0.05
    assert re.search(r"model observed +[\d.-]+ +[\d.-]+", report)
    from jtrain.recipes import report as report_command  # a typo'd run: in-process

    monkeypatch.chdir(cwd)
    assert report_command.main(["runs/typo"]) == 2
    assert capsys.readouterr().err.strip() == (
        "jtrain: report error: runs/typo: no summary.json (not a finished jtrain run)")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    cwd = _user_dir(tmp_path_factory.mktemp("pretrain"))
    out = _ok(run_python(cwd, "-m", "jtrain.main",
                         "--config=configs/recipes/masked_pretrain.py:debug",
                         "--workdir=runs/pretrain", "--config.total_steps=200",
                         "--config.eval.every_steps=200"))
    assert "80/10/10" in out
    return cwd


FT_STEPS = 40  # from-scratch ~0.77 eval accuracy here, each pretrained variant >= 0.95


def _finetune_in_process(cwd, kind):
    """One variant trained with jtrain.train in this process (the CLI's journey is the
    `full` variant's): its final eval accuracy."""
    import runpy

    import jtrain

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        config = runpy.run_path("configs/recipes/finetune.py")["get_config"](f"{kind},debug")
        config.total_steps = config.eval.every_steps = FT_STEPS
        return jtrain.train(config, f"runs/ft_{kind}").summary["eval/accuracy"]


@pytest.fixture(scope="module")
def scratch(pretrained):
    """The from-scratch baseline, trained once for every comparison."""
    return _finetune_in_process(pretrained, "scratch")


def test_pretrained_full_finetune_beats_scratch(pretrained, scratch, monkeypatch, capsys):
    out = _ok(run_python(pretrained, "-m", "jtrain.main",
                         "--config=configs/recipes/finetune.py:full,debug",
                         "--workdir=runs/ft_full", f"--config.total_steps={FT_STEPS}",
                         f"--config.eval.every_steps={FT_STEPS}"))
    full = _summary(pretrained, "runs/ft_full")["eval/accuracy"]
    assert "initialized from runs/pretrain" in out and "excluded (fresh init: cls_head" in out
    assert full > scratch + 0.05, (full, scratch)
    from jtrain.recipes import report  # its command line: test_imputation_beats_...

    monkeypatch.chdir(pretrained)
    assert report.main(["runs/ft_scratch", "runs/ft_full"]) == 0
    out = capsys.readouterr().out
    assert "from scratch" in out and "from runs/pretrain" in out


def test_pretrained_frozen_and_lora_beat_scratch(pretrained, scratch, capfd):
    capfd.readouterr()
    frozen = _finetune_in_process(pretrained, "frozen")
    out = "".join(capfd.readouterr())
    assert re.search(r"trainable \d+ params in 2 leaves; frozen", out), out
    lora = _finetune_in_process(pretrained, "lora")
    assert "LoRA adapter leaves not in the source" in "".join(capfd.readouterr())
    assert frozen > scratch + 0.05 and lora > scratch + 0.05, (frozen, lora, scratch)


def test_classify_early_stops_on_f1_and_evaluates_best(tmp_path):
    cwd = _user_dir(tmp_path)
    out = _ok(run_python(cwd, "-m", "jtrain.main", "--config=configs/recipes/classify.py:debug",
                         "--workdir=runs/cls", "--config.early_stop.patience=2",
                         "--config.early_stop.min_delta=0.05"))
    assert "stopped early at step" in out and "eval/f1_macro" in out
    summary = _summary(cwd, "runs/cls")
    assert summary["stopped_by"] == "early_stop" and summary["step"] < 300
    from jtrain import evaluate  # in-process: its command's journey is tests/journeys/

    assert evaluate.main([f"--workdir={cwd / 'runs/cls'}", "--step=best", "--noplots"]) == 0
    [name] = [f for f in os.listdir(cwd / "runs/cls") if f.startswith("eval_")]
    with open(cwd / "runs/cls" / name) as f:
        report = json.load(f)
    for key in ("eval/accuracy", "eval/f1_macro", "eval/precision_macro",
                "eval/recall_macro", "eval/auroc"):
        assert key in report["metrics"], key
    assert report["metrics"]["eval/f1_macro"] > 0.9 and report["num_examples"] == 113
    assert sum(map(sum, report["confusion_matrix"])) == 113
    assert set(report["classification_report"]) >= {"0", "1", "macro avg"}


AE_SCRIPT = '''
import runpy
import jtrain

config = runpy.run_path("configs/recipes/multiloss_autoencoder.py")["get_config"]("debug")
config.total_steps, config.eval.every_steps = 200, 100
result = jtrain.train(config, "runs/ae")
for row in result.history:
    print(row["step"], round(row["eval/recon_rna"], 4), round(row["eval/recon_protein"], 4),
          round(row["eval/latent_corr"], 4), round(row["eval/pearson"], 4))
'''


def test_multiloss_autoencoder_history_from_a_script(tmp_path):
    cwd = _user_dir(tmp_path)
    (cwd / "ae.py").write_text(AE_SCRIPT)
    out = _ok(run_python(cwd, "ae.py"))
    base = re.search(r"recon_rna ([\d.]+), recon_protein ([\d.]+)", out)
    rows = [line.split() for line in out.splitlines() if re.fullmatch(r"\d+( [-\d.]+){4}", line)]
    assert [int(r[0]) for r in rows] == [100, 200]
    last = [float(v) for v in rows[-1][1:]]
    assert last[0] < float(base.group(1)) and last[1] < float(base.group(2))  # beats the mean
    assert float(rows[0][3]) > last[2] and last[3] > 0.3  # the correlation term pulls z in
    assert sorted(os.listdir(cwd / "runs/ae/checkpoints")) == ["100", "200"]


@pytest.mark.slow
def test_set_completion_two_processes_plateau_and_early_stop(tmp_path):
    cwd = _user_dir(tmp_path)
    shutil.copytree(os.path.join(REPO, "launch"), cwd / "launch")
    proc = subprocess.run(
        ["launch/local.sh", "2", "--config=configs/recipes/set_completion.py:debug",
         "--workdir=runs/sets", "--config.total_steps=150", "--config.eval.every_steps=25",
         "--config.optim.warmup_steps=5", "--config.optim.lr=0.01",
         # no eval improves by 1000: the 2nd eval halves the lr, the 3rd stops (step 75)
         "--config.plateau.patience=0", "--config.plateau.min_delta=1000",
         "--config.early_stop.patience=2", "--config.early_stop.min_delta=1000"],
        cwd=cwd, env=user_env(DEVICES="1", PATH=os.path.dirname(sys.executable) + ":"
                              + os.environ["PATH"]),
        capture_output=True, text=True, timeout=600)
    out = _ok(proc)
    assert "2 process(es)" in out
    assert "learning-rate factor now 0.5" in out
    assert "stopped early at step 75" in out
    baseline = float(re.search(r"popularity baseline eval recall_at_10 ([\d.]+)", out).group(1))
    summary = _summary(cwd, "runs/sets")
    assert summary["eval/recall_at_10"] > 2 * baseline, (summary, baseline)
