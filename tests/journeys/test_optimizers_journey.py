"""Today's optimizers as users run them: a schedule-free run killed and resumed from the
CLI is bitwise the uninterrupted one, evaluates and exports its averaged params; a plain
script trains the user's own model with optim.name="muon". The schedule-free run is also
the journey of `--verify_resume --verify_kills=2` itself: PASS only with 2/2 kills landed
(a run asked for 2 kills that landed 1 printed PASS once)."""

import json

from journey import run_python

from test_journeys import CONFIG


def test_schedule_free_resume_is_bitwise_and_eval_uses_the_average(tmp_path):
    (tmp_path / "cfg.py").write_text(CONFIG)
    proc = run_python(tmp_path, "-m", "jtrain.main", "--config=cfg.py", "--workdir=runs/v",
                      "--config.optim.name=schedule_free_adamw",
                      "--config.optim.schedule=constant", "--config.total_steps=8",
                      "--config.checkpoint.every_steps=2", "--config.eval.every_steps=4",
                      "--verify_resume",
                      "--verify_kills=2", timeout=600)
    out = proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("jtrain: verify_resume:")]
    assert len(lines) == 1, out[-3000:]
    assert proc.returncode == 0 and lines[0].startswith(
        "jtrain: verify_resume: PASS: bitwise identical after 2/2 kills landed"), lines[0]
    assert (tmp_path / "runs" / "v" / "reference" / "summary.json").is_file()
    log = (tmp_path / "runs" / "v" / "reference" / "train.log").read_text()
    assert "schedule-free: evaluation uses its averaged params" in log, log[-3000:]
    export = run_python(tmp_path, "-m", "jtrain.export", "runs/v/reference", "--out=x")
    assert export.returncode == 0, export.stderr
    assert json.loads((tmp_path / "x" / "export.json").read_text())["schedule_free_average"]
    check = run_python(tmp_path, "-c", SF_EVAL_CHECK, timeout=600)
    assert check.returncode == 0, check.stderr[-3000:]
    result = json.loads(check.stdout.strip().splitlines()[-1])
    assert abs(result["evaluated"] - result["average"]) < 1e-5, result
    assert abs(result["evaluated"] - result["raw"]) > 1e-4, result
    assert result["export_vs_average"] < 1e-6, result  # the export is the averaged params
    assert result["export_vs_raw"] > 1e-5, result


SF_EVAL_CHECK = '''
import json, jax, optax
import jtrain.engine.checkpoint_eval as ev
import jtrain.engine.evaluation as evaluator
from jtrain import optim
seen, losses = {}, {}
real_params, real_eval = optim.schedule_free_eval_params, evaluator.run_eval
def params_spy(opt_state, params):
    seen["raw"], seen["state"] = params, opt_state
    return real_params(opt_state, params)
def eval_spy(step, params, *a, **k):
    sf = [s for s in jax.tree.leaves(seen["state"], is_leaf=lambda x: isinstance(
        x, optax.contrib.ScheduleFreeState)) if isinstance(s, optax.contrib.ScheduleFreeState)]
    average = optax.contrib.schedule_free_eval_params(sf[0], seen["raw"])
    seen["average"] = average
    for name, p in (("raw", seen["raw"]), ("average", average)):
        losses[name] = real_eval(step, p, *a, **k).scalars["eval/loss"]
    result = real_eval(step, params, *a, **k)
    losses["evaluated"] = result.scalars["eval/loss"]
    return result
optim.schedule_free_eval_params, evaluator.run_eval = params_spy, eval_spy
ev.evaluate_checkpoint("runs/v/reference", num_batches=2, plots=False)
import numpy as np
from jtrain.checkpoint import export as ex, integrity
tensors, _ = ex.read_safetensors("x/params.safetensors")
for name in ("average", "raw"):
    flat = {integrity.leaf_path(p): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(seen[name])[0]}
    assert set(flat) == set(tensors), (sorted(flat), sorted(tensors))
    losses[f"export_vs_{name}"] = max(float(np.max(np.abs(tensors[k] - flat[k])))
                                      for k in tensors)
print(json.dumps(losses))
'''


def test_script_trains_the_users_model_with_muon(tmp_path):
    (tmp_path / "train_muon.py").write_text(MUON_SCRIPT)
    proc = run_python(tmp_path, "train_muon.py", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "jtrain: optimizer muon" in proc.stdout + proc.stderr
    assert "muon on 2 2-D leaves" in proc.stdout + proc.stderr
    assert "done" in proc.stdout


MUON_SCRIPT = '''
import numpy as np
import flax.linen as nn
import jtrain


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(3)(nn.relu(nn.Dense(16)(x)))


r = np.random.default_rng(0)
x = r.normal(size=(64, 5)).astype(np.float32)
data = {"inputs": x, "targets": (x[:, 0] > 0).astype(np.int32)}
summary = jtrain.train({"total_steps": 4, "optim": {"name": "muon", "lr": 0.02},
                        "data": {"batch_size": 16}, "eval": {"every_steps": 4}},
                       "runs/muon", model=MLP(), train_data=data)
print("done", summary)
'''


OPTAX_CONFIG = '''
from jtrain.config import defaults


def get_config():
    c = defaults(model="transformer")
    c.total_steps = 3
    c.model.update(d_model=16, num_layers=1, num_heads=2, d_ff=32, max_len=16)
    c.data.update(name="pystdlib", seq_len=16, batch_size=4)
    c.eval.every_steps = 0
    c.optim.name = "optax.adabelief"  # not one of jtrain's names
    c.optim.kwargs = {"b1": 0.8, "eps": 1e-12}
    return c
'''


def test_a_config_file_names_an_optax_function(tmp_path):
    """A newcomer's optimizer, named in the config file with its arguments: the run
    trains with it; a name optax lacks is one line and exit 2 before any step."""
    (tmp_path / "cfg.py").write_text(OPTAX_CONFIG)
    proc = run_python(tmp_path, "-m", "jtrain.main", "--config=cfg.py", "--workdir=runs/o")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "jtrain: optimizer optax.adabelief, peak lr" in proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "runs" / "o" / "summary.json").read_text())
    assert summary["step"] == 3
    config = json.loads((tmp_path / "runs" / "o" / "config.json").read_text())
    assert config["optim"]["kwargs"] == {"b1": 0.8, "eps": 1e-12}
    bad = run_python(tmp_path, "-m", "jtrain.main", "--config=cfg.py", "--workdir=runs/b",
                     "--config.optim.name=optax.adabelieff")
    lines = [ln for ln in bad.stderr.splitlines() if ln.strip()]
    assert bad.returncode == 2 and lines == [
        "jtrain: config error: optim.name: optax has no public function 'adabelieff' "
        "(names look like optax.lion, optax.contrib.muon)"], bad.stderr[-3000:]
    assert not (tmp_path / "runs" / "b" / "summary.json").exists()
