"""The weight EMA as its users meet it, in subprocesses from a temp cwd: a plain script
training their own NNX model with `optim.ema` and `eval.weights="both"` (the header line,
both metric sets, the EMA taken out with `jtrain.state.eval_params`); the CLI with
`optim.ema.decay` in the config file, SIGKILLed twice and restarted by jtrain's resume
verifier (bitwise identical to the same config trained straight through in the test's
process, the EMA inside the compared state), then `python -m jtrain.evaluate
--weights=ema` and `python -m jtrain.export --weights=ema` on that run (and the export
command's `--weights=params` in this process)."""

import json
import runpy

import numpy as np

from jtrain.checkpoint.export import load_checkpoint_leaves, read_safetensors

from journey import copy_project, killed_and_restarted, run_python

SCRIPT = '''
import jax
import numpy as np
from flax import nnx
import jtrain
from nnx_mlp import Model  # the user's own module

r = np.random.default_rng(0)
x = r.normal(size=(64, 4)).astype(np.float32)
data = {"inputs": x, "targets": (x[:, 0] > 0).astype(np.int32)}
config = {"total_steps": 6, "data": {"batch_size": 8},
          "eval": {"every_steps": 3, "weights": "both"},
          "optim": {"lr": 0.05, "ema": {"decay": 0.99, "warmup": "standard"}},
          "log": {"writers": ["jsonl"]}}
result = jtrain.train(config, "runs/a", model=Model(nnx.Rngs(0)), train_data=data,
                      eval_data=data)
ema = jtrain.state.eval_params(result.state, "ema")
moved = any(not np.array_equal(a, b) for a, b in
            zip(jax.tree.leaves(ema), jax.tree.leaves(result.state.params)))
print("RESULT", sorted(k for k in result.history[-1] if k.endswith("/loss")), moved)
'''


def test_script_with_an_nnx_model_evaluates_params_and_ema(tmp_path):
    copy_project(tmp_path, "nnx_mlp")
    (tmp_path / "script.py").write_text(SCRIPT)
    proc = run_python(tmp_path, "script.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "jtrain: weight EMA on: decay 0.99 (warmup standard)" in out, out[-3000:]
    assert "bytes per device; eval.weights=both" in out
    assert "ema/loss" in out  # the eval line shows both
    assert "RESULT ['eval/ema/loss', 'eval/loss'] True" in proc.stdout, proc.stdout[-2000:]


CONFIG = '''
from jtrain.config import defaults


def get_config():
    c = defaults(model="mlp")
    c.seed = 0
    c.total_steps = 8
    c.model.hidden = (16,)
    c.model.num_outputs = 3
    c.data.source = "mydata:make"
    c.data.kwargs = {"classes": 3}  # 64 rows train, 32 evaluate
    c.data.batch_size = 8
    c.optim.lr = 0.05
    c.optim.ema.decay = 0.9
    c.eval.every_steps = 4
    c.eval.weights = "both"
    c.checkpoint.every_steps = 2
    return c
'''


def test_cli_ema_resumes_bitwise_then_evaluate_and_export_the_ema(tmp_path, capsys):
    (tmp_path / "cfg.py").write_text(CONFIG)
    copy_project(tmp_path, "mydata")
    config = runpy.run_path(str(tmp_path / "cfg.py"))["get_config"]()
    run = killed_and_restarted(tmp_path, config, ["-m", "jtrain.main", "--config=cfg.py"],
                               "runs/v", kills=2, modules=("mydata",))

    proc = run_python(tmp_path, "-m", "jtrain.evaluate", f"--workdir={run}", "--weights=ema",
                      "--noplots")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ema/loss" in proc.stdout and " loss " not in proc.stdout.split(":", 2)[-1]
    report = json.loads((run / "eval_8.json").read_text())
    assert report["weights"] == "ema" and "eval/ema/loss" in report["metrics"]
    assert "eval/loss" not in report["metrics"] and "ema_confusion_matrix" in report
    summary = json.loads((run / "summary.json").read_text())
    assert abs(report["metrics"]["eval/ema/loss"] - summary["eval/ema/loss"]) < 1e-6

    proc = run_python(tmp_path, "-m", "jtrain.export", f"--workdir={run}", "--out=ex_ema",
                      "--weights=ema")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(the weight EMA)" in proc.stdout, proc.stdout
    # --weights=params: the export command's main, in this process, its flags parsed from
    # the same command line
    out = _export_in_process(capsys, f"--workdir={run}", f"--out={tmp_path / 'ex_params'}",
                             "--weights=params")
    assert out.startswith("jtrain: exported step 8") and "(the weight EMA)" not in out, out
    # the files the exports wrote, read here (the user's reading of them is the export's
    # own journey): the EMA export holds the checkpoint's EMA, the params one its params
    ema, _ = read_safetensors(str(tmp_path / "ex_ema" / "params.safetensors"))
    params, _ = read_safetensors(str(tmp_path / "ex_params" / "params.safetensors"))
    saved = load_checkpoint_leaves(str(run / "checkpoints" / "8"), ("params", "ema"))
    assert sorted(ema) == sorted(params)
    assert all(np.array_equal(ema[k], saved["ema/" + k]) for k in ema)
    assert all(np.array_equal(params[k], saved["params/" + k]) for k in params)
    assert any(not np.array_equal(ema[k], params[k]) for k in ema)
    assert json.loads((tmp_path / "ex_ema" / "export.json").read_text())["weights"] == "ema"
    assert np.isfinite(report["metrics"]["eval/ema/accuracy"])


def _export_in_process(capsys, *argv) -> str:
    """What `python -m jtrain.export ARGV` prints, its main run here on flags parsed into
    a FlagValues of its own (the process's absl flags untouched)."""
    from absl import flags

    from jtrain.cli import export

    fv = flags.FlagValues()
    export.define_flags(fv)
    args = fv(["export", *argv])[1:]
    capsys.readouterr()
    assert export.main(fv, args) == 0
    return capsys.readouterr().out
