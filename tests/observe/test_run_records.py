"""A run's records compose with the public pieces: config.json is exactly the resolved
config and feeds back into `jtrain.train` / `jtrain.resolve` unchanged (also when the
model or loss came from Python); run.json holds where they came from and what the
set-up decided beyond the config (a memory plan's grad_accum_steps, a torch DataLoader's
settings), repeated in summary.json; one run resolves its config exactly once."""

import json
import textwrap

import pytest

from journey import copy_project, run_python

MODEL = """
import json
import numpy as np
import jtrain
import mydata
from flax import nnx
from mymodels import Net as MyNet


def Net(rngs):  # their NNX classifier: 4 features -> 16 -> 3 classes
    return MyNet(16, rngs, classes=3)


d = mydata.make(96, train=None, classes=3)
data = (d["inputs"], d["targets"])
"""


# One user script, three runs (each test reads its own line, tagged): config.json fed
# back, a torch DataLoader's settings, a memory plan's grad_accum_steps.
FEEDS_BACK = """
    import jtrain.config as config_lib

    calls = []
    resolve = config_lib.resolve

    def counted(*args, **kwargs):  # every resolution of this process
        calls.append(1)
        return resolve(*args, **kwargs)

    config_lib.resolve = counted
    cfg = {"total_steps": 6, "seed": 3, "data": {"batch_size": 16},
           "eval": {"every_steps": 3}, "log": {"verbosity": 0, "writers": ["jsonl"]}}
    first = jtrain.train(cfg, "runs/a", model=Net(nnx.Rngs(0)), train_data=data)
    resolutions = len(calls)
    recorded = json.load(open("runs/a/config.json"))
    record = json.load(open("runs/a/run.json"))
    again = jtrain.train(recorded, "runs/b", model=Net(nnx.Rngs(0)), train_data=data)
    # an older run's config.json kept its run records beside the config
    old = jtrain.resolve({**recorded, "model_source": "python: user Net",
                          "loss_source": "python: my_loss"})
    def as_json(c):
        return json.loads(json.dumps(c.to_dict(), default=str))

    print("feeds_back", json.dumps({"resolutions": resolutions, "record": record,
                                    "keys": sorted(recorded),
                                    "same": again.summary["state_sha256"]
                                    == first.summary["state_sha256"],
                                    "resolved": as_json(jtrain.resolve(recorded)) == recorded
                                    and as_json(old) == recorded}))
"""

DATALOADER = """
    import torch

    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.tensor(data[0]), torch.tensor(data[1])),
        batch_size=12, shuffle=False, drop_last=True)
    cfg = {"total_steps": 3, "data": {"batch_size": 32},
           "eval": {"every_steps": 0}, "log": {"verbosity": 0, "writers": ["jsonl"]}}
    result = jtrain.train(cfg, "runs/t", model=Net(nnx.Rngs(0)), train_data=loader)
    print("dataloader", json.dumps({"config": json.load(open("runs/t/config.json"))["data"],
                                    "run": json.load(open("runs/t/run.json"))["decided"],
                                    "summary": result.summary["decided"]}))
"""

MEMORY_PLAN = """
    import jax
    from jtrain.control import memory

    def cfg(**over):
        return {"total_steps": 2, "seed": 0, "data": {"batch_size": 64},
                "eval": {"every_steps": 0}, "checkpoint": {"every_steps": 0},
                "log": {"verbosity": 0, "writers": ["jsonl"]}, **over}

    need = {}
    for k in (1, 2, 4, 8):
        b = jtrain.build(jtrain.resolve(cfg(optim={"grad_accum_steps": k})),
                         sample=data[0][0], model=Net(nnx.Rngs(0)),
                         eval_example={"inputs": data[0][0], "targets": data[1][0]})
        batch = {"inputs": jax.ShapeDtypeStruct((64, 4), data[0].dtype),
                 "targets": jax.ShapeDtypeStruct((64,), data[1].dtype)}
        need[k] = memory.step_bytes(b.train_step.lower(b.abstract, batch).compile())
    budget = (need[1] + min(need.values())) // 2
    expected = min(k for k in need if need[k] <= budget)
    result = jtrain.train(cfg(memory={"budget_bytes": budget}), "runs/m",
                          model=Net(nnx.Rngs(0)), train_data=data)
    print("memory_plan", json.dumps({"expected": expected, "need": need,
                                     "config": json.load(open("runs/m/config.json"))["optim"],
                                     "run": json.load(open("runs/m/run.json"))["decided"],
                                     "summary": json.load(open("runs/m/summary.json"))["decided"],
                                     "log": open("runs/m/train.log").read()}))
"""


@pytest.fixture(scope="module")
def script_out(tmp_path_factory) -> dict:
    """The user's script run once: {tag: what that part printed}."""
    tmp_path = tmp_path_factory.mktemp("records")
    copy_project(tmp_path, "mymodels", "mydata")
    body = "".join(textwrap.dedent(part) for part in (FEEDS_BACK, DATALOADER, MEMORY_PLAN))
    (tmp_path / "script.py").write_text(textwrap.dedent(MODEL) + body)
    proc = run_python(tmp_path, "script.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    tagged = [ln.split(" ", 1) for ln in proc.stdout.splitlines()]
    return {t[0]: json.loads(t[1]) for t in tagged if len(t) == 2 and t[1].startswith("{")}


def test_config_json_feeds_back_into_train_and_resolve(script_out):
    result = script_out["feeds_back"]
    assert result["resolutions"] == 1
    assert result["record"] == {"model_source": "python: user Net", "decided": {}}
    assert "model_source" not in result["keys"]
    assert result["same"], "the same config, model and data trained to another state"
    assert result["resolved"]


def test_a_dataloader_s_settings_are_recorded_as_decided(script_out):
    result = script_out["dataloader"]
    assert result["config"]["batch_size"] == 12  # the run's config: what it used
    assert result["run"]["data.batch_size"] == {"value": 12, "from": "DataLoader"}
    assert result["run"]["data.shuffle"] == {"value": False, "from": "DataLoader"}
    assert result["summary"] == result["run"]


def test_a_memory_plan_s_grad_accum_steps_is_recorded(script_out):
    result = script_out["memory_plan"]
    assert result["expected"] > 1, result["need"]
    assert result["config"]["grad_accum_steps"] == 1  # the config as given, resolved
    used = {"value": result["expected"], "from": "memory plan", "configured": 1}
    assert result["run"]["optim.grad_accum_steps"] == used
    assert result["summary"]["optim.grad_accum_steps"] == used
    assert (f"{result['expected']} microbatch(es) per update (the memory plan; "
            "optim.grad_accum_steps=1)") in result["log"]


def test_the_command_line_resolves_the_config_once(tmp_path):
    """`python -m jtrain.main` resolves before it waits for peers and hands that object
    to the run: one resolution per process, as from Python."""
    (tmp_path / "cfg.py").write_text(textwrap.dedent("""
        def get_config():
            return {"model": {"name": "mlp", "hidden": (8,), "num_outputs": 3},
                    "data": {"source": "blobs:make", "batch_size": 16},
                    "total_steps": 2, "eval": {"every_steps": 0}}
    """))
    copy_project(tmp_path, "mymodels", "mydata")
    (tmp_path / "blobs.py").write_text(textwrap.dedent(MODEL) + textwrap.dedent("""
        def make():
            return data
    """))
    (tmp_path / "counted_main.py").write_text(textwrap.dedent("""
        import sys
        import jtrain.config as config_lib

        resolve = config_lib.resolve

        def counted(*args, **kwargs):
            sys.stderr.write("RESOLVED\\n")
            return resolve(*args, **kwargs)

        config_lib.resolve = counted
        from jtrain import main
        main.run()
    """))
    proc = run_python(tmp_path, "counted_main.py", "--config=cfg.py", "--workdir=run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("RESOLVED") == 1, proc.stderr[-3000:]
    assert json.load(open(tmp_path / "run" / "config.json"))["total_steps"] == 2
