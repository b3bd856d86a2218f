"""Papercuts users hit, as they hit them: a plain script (no absl app, no test helpers)
in a fresh cwd with a relative workdir, run with the venv's python.

* Data worker processes from a plain script: grain reads an absl flag while it starts
  them, which raised UnparsedFlagAccessError unless absl flags were parsed (tests/
  conftest.py marks them parsed, so only a subprocess shows it; one grain worker is
  enough to start that path). The workers are spawned, never forked beside the live JAX
  runtime.
* `model=MyModel`, an NNX Module class taking `rngs`, is built like a function
  rngs -> module (it was refused with a TypeError naming ModuleMeta).
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from flax import linen as nn, nnx

from jtrain.models import adapters

HEADER = '''
import sys

import numpy as np
from flax import nnx

import jtrain


class Squares:  # map-style (len + getitem): what a torch or a grain DataLoader reads
    def __len__(self):
        return 64

    def __getitem__(self, i):
        x = np.full((4,), i / 64, np.float32)
        return {"inputs": x, "targets": np.float32(x.sum())}


class Net(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(4, 8, rngs=rngs)
        self.b = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.b(nnx.relu(self.a(x)))[..., 0]


def announce(worker_id):
    # a spawned worker runs this script again as __mp_main__ (a forked one: __main__)
    print(f"worker {worker_id} started as {sys.modules['__main__'].__name__}", flush=True)


if __name__ == "__main__":
    config = jtrain.defaults()
    config["total_steps"] = 6
    config["data"]["batch_size"] = 8
'''

RUNS = {
    "config_num_workers": '''
    config["data"]["num_workers"] = 2
    jtrain.train(config, "runs/x", model=Net(nnx.Rngs(0)), train_data=Squares())
''',
    "torch_dataloader": '''
    import torch

    loader = torch.utils.data.DataLoader(Squares(), batch_size=8, shuffle=True,
                                         num_workers=2, worker_init_fn=announce)
    jtrain.train(config, "runs/x", model=Net, train_data=loader)  # the class itself
''',
    "grain_dataloader": '''
    import grain

    sampler = grain.samplers.IndexSampler(64, shard_options=grain.sharding.ShardByJaxProcess(),
                                          shuffle=True, num_epochs=None, seed=0)
    loader = grain.DataLoader(data_source=Squares(), sampler=sampler,
                              operations=[grain.transforms.Batch(8)], worker_count=1)
    eval_data = (np.zeros((8, 4), np.float32), np.zeros((8,), np.float32))
    jtrain.train(config, "runs/x", model=Net(nnx.Rngs(0)), train_data=loader,
                 eval_data=eval_data)
''',
}


def run_script(tmp_path, body: str) -> subprocess.CompletedProcess:
    (tmp_path / "script.py").write_text(HEADER + textwrap.indent(textwrap.dedent(body), "    "))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run([sys.executable, "script.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def assert_trained(tmp_path, proc, workdir: str) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "UnparsedFlagAccessError" not in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / workdir / "summary.json").read_text())
    assert summary["step"] == 6
    return summary


# (data.num_workers from a config goes through the same pipeline.with_workers as the
# torch DataLoader case; it is not run separately to keep the suite's time.)
def test_plain_script_trains_with_data_workers(tmp_path):
    """One script, two runs: a grain DataLoader with a worker (first, so that nothing in
    the process has parsed absl flags before grain starts it), then a torch DataLoader
    with two workers."""
    pytest.importorskip("torch")
    first = RUNS["grain_dataloader"].replace('"runs/x"', '"runs/grain"')
    proc = run_script(tmp_path, first + RUNS["torch_dataloader"])
    seen = proc.stdout + proc.stderr  # jtrain's log lines go to stderr
    assert seen.count("jtrain: done at step 6") == 2, seen[-2000:]
    assert_trained(tmp_path, proc, "grain")
    assert_trained(tmp_path, proc, "x")
    assert "num_workers=2" in proc.stderr  # the header says the loader's setting is used
    for w in (0, 1):  # both workers ran the user's worker_init_fn, in spawned processes
        assert f"worker {w} started as __mp_main__" in proc.stdout, proc.stdout[-2000:]
    # the torch run passes `model=Net`, the NNX class: built like its factory
    header = [ln for ln in proc.stderr.splitlines() if ln.startswith("jtrain: model")][-1]
    assert "(nnx)" in header and "ModuleMeta" not in header, header


class Pair(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, width: int = 3):
        self.a = nnx.Linear(2, width, rngs=rngs)
        self.b = nnx.Linear(width, 1, rngs=rngs)

    def __call__(self, x):
        return self.b(self.a(x))


def test_nnx_class_is_built_like_its_factory():
    rng, x = jax.random.key(7), np.ones((4, 2), np.float32)
    from_class = adapters.to_model_fns(Pair)
    from_factory = adapters.to_model_fns(lambda rngs: Pair(rngs=rngs))
    assert from_class.kind == "nnx" and from_class.existing_params is None
    p1, p2 = from_class.init(rng, x), from_factory.init(rng, x)
    assert jax.tree.all(jax.tree.map(np.array_equal, p1, p2))
    assert from_class.apply(p1, x).shape == (4, 1)


def test_classes_that_cannot_be_built_say_how_to_pass_them():
    class NeedsWidth(nnx.Module):
        def __init__(self, width, rngs):
            self.a = nnx.Linear(2, width, rngs=rngs)

    class NoRngs(nnx.Module):
        def __init__(self, width=3):
            self.width = width

    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(x)

    with pytest.raises(TypeError, match=r"NeedsWidth.*also needs width.*pass an instance"):
        adapters.to_model_fns(NeedsWidth)
    with pytest.raises(TypeError, match=r"NoRngs.*takes no rngs"):
        adapters.to_model_fns(NoRngs)
    with pytest.raises(TypeError, match=r"Dense is a flax.linen.Module class; pass an instance"):
        adapters.to_model_fns(Dense)
