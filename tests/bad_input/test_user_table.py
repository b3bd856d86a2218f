"""Every bad input a user's model, data or loss can have is caught before the first
step, in one line naming the field or key, with its exit code.

TABLE lists the inputs (docs/guide/troubleshooting.md shows the same table, checked below);
USER_MODULE below builds each row's data, model (a Linen and an NNX version of each, alternating
between rows) and loss. Each row runs as real processes:

* `cli`: `jtrain train --config=cfg.py:<row>` (the config names the row's functions in
  data.source, model.factory and loss.fn);
* `py`: `python script.py <row>`, a plain script that builds the objects and calls
  `jtrain.train(config, workdir, model=..., train_data=..., eval_data=..., loss_fn=...)`,
  printing `jtrain.errors.render(e)` for the JtrainError it raises.

Each asserts its exit code, exactly one line on stderr holding the row's text, no
`Traceback`, and nothing trained (no metrics.jsonl, no checkpoint). One server process
imports jtrain once and forks a child per run (tests/bad_input/test_failure_table.py's
mechanism), two children at a time.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest

from journey import user_env

REPO = Path(__file__).resolve().parents[2]

USER_MODULE = '''
"""A user's data, models and losses for the table's rows."""
import jax.numpy as jnp
import numpy as np
from flax import linen as nn, nnx

N = 32


def _x(n=N, d=4, seed=0):
    return np.random.default_rng(seed).normal(size=(n, d)).astype(np.float32)


def _y(n=N):
    return np.arange(n, dtype=np.int32) % 3


class LinenNet(nn.Module):
    width: int = 3
    kind: str = "plain"

    @nn.compact
    def __call__(self, x, train=False):
        if self.kind == "needs5" and x.shape[-1] != 5:
            raise ValueError(f"LinenNet wants 5 features, got {x.shape[-1]}")
        y = nn.Dense(self.width)(x)
        if self.kind == "dict":
            return {"logits": y}
        if self.kind == "tuple":
            return y, x
        return y


class NnxNet(nnx.Module):
    def __init__(self, rngs, width=3, kind="plain"):
        self.kind = kind
        self.dense = nnx.Linear(4, width, rngs=rngs)

    def __call__(self, x):
        if self.kind == "needs5" and x.shape[-1] != 5:
            raise ValueError(f"NnxNet wants 5 features, got {x.shape[-1]}")
        y = self.dense(x)
        if self.kind == "dict":
            return {"logits": y}
        if self.kind == "tuple":
            return y, x
        return y


def linen(width=3, kind="plain"):
    return LinenNet(width, kind)


def nnx_model(width=3, kind="plain"):
    return lambda rngs: NnxNet(rngs, width, kind)


def factory_raises(**_):
    raise RuntimeError("weights file model.bin not found")


def not_a_model(**_):
    return 42


# -- data (data.source)
def clean():
    return {"inputs": _x(), "targets": _y()}


def targets_2():
    return {"inputs": _x(), "targets": _x()[:, :2]}


def labels_5():
    y = _y()
    y[7] = 5
    return {"inputs": _x(), "targets": y}


def float_labels():
    return {"inputs": _x(), "targets": _y().astype(np.float32)}


def int_counts():
    return {"inputs": _x(), "targets": np.arange(N, dtype=np.int32) % 7}


def all_nan():
    x = _x()
    x[:, 1] = np.nan
    return {"inputs": x, "targets": _y()}


def mask_2d():
    return {"inputs": _x(), "targets": _y(), "weights": np.ones((N, 2), np.float32)}


def short_targets():
    return {"inputs": _x(), "targets": _y(N - 2)}


def generator():
    def gen():
        for i in range(N):
            yield {"inputs": _x()[i], "targets": np.int32(i % 3)}
    return gen()


def loader_7():
    import torch

    ds = torch.utils.data.TensorDataset(torch.tensor(_x()), torch.tensor(_y()).long())
    return torch.utils.data.DataLoader(ds, batch_size=7, drop_last=False)


def strings():
    return {"inputs": np.array([f"s{i}" for i in range(N)]), "targets": _y()}


def objects():
    inputs = np.empty(N, dtype=object)
    inputs[:] = [object() for _ in range(N)]
    return {"inputs": inputs, "targets": _y()}


def empty():
    return {"inputs": _x(0), "targets": _y(0)}


def eval_renamed():
    return {"train": clean(), "eval": {"inputs": _x(16), "label": _y(16)}}


# -- losses (loss.fn)
def per_example(outputs, batch):
    import optax
    return optax.softmax_cross_entropy_with_integer_labels(outputs, batch["targets"])


def nan_loss(outputs, batch):
    return jnp.mean(outputs) * jnp.nan
'''

CONFIG = '''
from jtrain.config import defaults

ROWS = {rows!r}


def get_config(row):
    data, model, loss, over = ROWS[row]
    c = defaults("user")
    c.total_steps = 2
    c.data.batch_size = 8
    c.data.val_fraction = 0.0
    c.eval.every_steps = 2
    c.log.verbosity = 0
    c.checkpoint.every_steps = 0
    c.data.source = "bad_user:" + data
    c.model.factory = "bad_user:" + model
    if loss:
        c.loss.fn = "bad_user:" + loss
    for key, value in over.items():
        node = c
        *path, last = key.split(".")
        for part in path:
            node = node[part]
        node[last] = value
    return c
'''

SCRIPT = '''
"""A plain script: the row's objects, passed to jtrain.train."""
import sys

import jtrain
from jtrain import errors

import bad_user
import cfg

data, model, loss, over = cfg.ROWS[sys.argv[1]]
config = cfg.get_config(sys.argv[1])
made = getattr(bad_user, data)()
train_data, eval_data = (made["train"], made.get("eval")) if isinstance(made, dict) \\
    and "train" in made else (made, None)
config.data.source = ""
config.loss.fn = ""
factory = getattr(bad_user, model)
try:
    obj = factory(**config.model.kwargs)
    jtrain.train(config, "runs/py_" + sys.argv[1], model=obj, train_data=train_data,
                 eval_data=eval_data, loss_fn=getattr(bad_user, loss) if loss else None)
except errors.JtrainError as e:
    print(errors.render(e), file=sys.stderr)
    sys.exit(e.exit_code)
'''

SERVER = textwrap.dedent('''
    import json, os, runpy, sys, time
    import jtrain.cli, jtrain.engine.run  # the imports, once; JAX's backend starts in children
    import flax.linen, flax.nnx, optax, torch
    jobs, running, results = json.load(sys.stdin), {}, {}

    def start(job):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid:
            running[pid] = (job["id"], time.monotonic())
            return
        code = 99
        try:
            os.chdir(job["cwd"])
            sys.path.insert(0, job["cwd"])
            os.environ.update(job["env"])
            for fd, name in ((1, "stdout"), (2, "stderr")):
                out = os.open(os.path.join(job["out"], name),
                              os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(out, fd)
            sys.argv = list(job["argv"])
            if job["argv"][0] == "jtrain":
                code = jtrain.cli.main(job["argv"][1:])
            else:
                runpy.run_path(job["argv"][0], run_name="__main__")
                code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    while jobs or running:
        while jobs and len(running) < 2:
            start(jobs.pop(0))
        pid, status = os.wait()
        job_id, t0 = running.pop(pid)
        results[job_id] = [os.waitstatus_to_exitcode(status), round(time.monotonic() - t0, 2)]
    print(json.dumps(results))
''')

class Row(NamedTuple):
    id: str
    what: str  # the bad input, as the guide's table says it
    data: str
    model: str  # linen / nnx_model (or a factory that fails)
    loss: str | None
    config: dict  # dotted config keys
    kind: str
    line: str  # in the one line, after "jtrain: <kind> error: "
    code: int = 2
    modes: tuple = ("cli", "py")
    env: dict = {}


L, X = "linen", "nnx_model"
TABLE = [
    Row("outputs_vs_targets", "outputs of another shape than the loss's targets",
        "targets_2", L, None, {}, "data",
        "train_data: targets of shape (2,) per example against model outputs of shape (3,)"),
    Row("dict_outputs", "a dict of outputs with the default loss", "clean", X, None,
        {"model.kwargs": {"kind": "dict"}}, "data",
        "model: it returns a pytree of outputs (e.g. a dict of heads), which the default "
        "loss cannot score"),
    Row("label_out_of_range", "a class label outside 0..classes-1", "labels_5", L, None, {},
        "data", "train_data: example 7 has class label 5, outside 0..2"),
    Row("float_labels", "float labels for a classifier", "float_labels", X, None, {}, "data",
        "train_data: float targets that hold class labels"),
    Row("int_targets_mse", "integer targets for a regressor (MSE)", "int_counts", L, None,
        {"model.kwargs": {"width": 1}}, "data",
        "train_data: integer targets (class labels) against 1 model output per example"),
    Row("nan_first_batch", "NaN in every example of the first batch", "all_nan", X, None,
        {}, "data", "train_data: all 8 examples of the first batch hold NaN or inf"),
    Row("tuple_outputs", "a model returning a tuple (default loss)", "clean", L, None,
        {"model.kwargs": {"kind": "tuple"}}, "data",
        "model: it returns a pytree of outputs"),
    Row("loss_not_scalar", "a loss returning one value per example", "clean", X,
        "per_example", {}, "data", "loss_fn: the loss has shape (2,)"),
    Row("weights_shape", "per-example weights (a mask) of the wrong shape", "mask_2d", L,
        None, {}, "data", "train_data: weights of shape (2,) per example"),
    Row("batch_size_mismatch", "fields with different numbers of examples",
        "short_targets", X, None, {}, "data",
        "train_data: fields have different lengths {'inputs': 32, 'targets': 30}"),
    Row("generator_no_length", "a generator (no length) and no total_steps", "generator",
        L, None, {}, "data", "train_data: an iterator or generator can be read only once"),
    Row("loader_not_divisible", "a DataLoader (drop_last=False) whose batch does not "
        "split over the devices", "loader_7", X, None, {}, "config",
        "data.batch_size: global batch 7 is not divisible by the data-parallel size 2",
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}),
    Row("factory_missing", "a model.factory that does not exist", "clean", "nothing", None,
        {}, "config", "model.factory: 'bad_user' has no attribute 'nothing'", modes=("cli",)),
    Row("factory_raises", "a model.factory that raises", "clean", "factory_raises", None,
        {}, "config", "model.factory: bad_user:factory_raises(**{}) raised RuntimeError: "
        "weights file model.bin not found", modes=("cli",)),
    Row("factory_not_a_model", "a model.factory that returns no model", "clean",
        "not_a_model", None, {}, "config", "model.factory: bad_user:not_a_model(**{}) "
        "returned no model: expected a flax.linen.Module", modes=("cli",)),
    Row("not_a_model", "jtrain.train(model=...) given something that is not a model",
        "clean", "not_a_model", None, {}, "config", "model: expected a flax.linen.Module",
        modes=("py",)),
    Row("init_fails", "a model whose init fails on the example batch", "clean", L, None,
        {"model.kwargs": {"kind": "needs5"}}, "data",
        "model: calling LinenNet on the first batch's inputs"),
    Row("string_inputs", "string inputs", "strings", X, None, {}, "data",
        "train_data[0].inputs: <U2 values (str_) cannot go to a device"),
    Row("object_inputs", "object (Python) inputs", "objects", L, None, {}, "data",
        "train_data[0].inputs: object values (object) cannot go to a device"),
    Row("empty_dataset", "an empty dataset", "empty", X, None, {}, "data",
        "train_data: the dataset is empty"),
    Row("eval_fields_differ", "eval data whose fields differ from train's", "eval_renamed",
        L, None, {}, "data", "eval_data[0]: no 'targets' field (fields: inputs, label)"),
    Row("model_inputs_missing", "data.model_inputs naming a missing field", "clean", X, None,
        {"data.model_inputs": ("image",)}, "config",
        "data.model_inputs: no field 'image' in the data's items (fields: inputs, targets)"),
    Row("loss_nan_at_init", "a loss that is NaN on the first batch", "clean", L, "nan_loss",
        {}, "non-finite", "step 1: the loss is NaN or inf on the first batch", code=4),
    Row("loss_term_output_missing", "a loss.terms entry naming an output that does not "
        "exist", "clean", X, None, {"model.kwargs": {"kind": "dict"}, "loss.terms": {
            "ce": {"fn": "cross_entropy", "output": "logit"}}}, "config",
        "loss.terms.ce.output: output 'logit' not found (at 'logit'; have ['logits'])"),
]

RUNS = [(row.id, mode) for row in TABLE for mode in row.modes]


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """{(row, mode): (exit code, stdout, stderr)}, each a forked process."""
    user = tmp_path_factory.mktemp("user")
    (user / "bad_user.py").write_text(USER_MODULE)
    rows = {r.id: (r.data, r.model, r.loss, r.config) for r in TABLE}
    (user / "cfg.py").write_text(CONFIG.format(rows=rows))
    (user / "script.py").write_text(SCRIPT)
    jobs = []
    for row in TABLE:
        for mode in row.modes:
            out = user / "out" / f"{mode}_{row.id}"
            out.mkdir(parents=True)
            argv = (["jtrain", "train", f"--config=cfg.py:{row.id}",
                     f"--workdir=runs/cli_{row.id}"] if mode == "cli"
                    else ["script.py", row.id])
            jobs.append({"id": f"{mode}_{row.id}", "argv": argv, "cwd": str(user),
                         "out": str(out), "env": {"JAX_PLATFORMS": "cpu", **row.env}})
    proc = subprocess.run([sys.executable, "-c", SERVER], input=json.dumps(jobs), cwd=user,
                          env=user_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    print("run seconds:", {k: t for k, (_, t) in codes.items()})  # -s shows it
    return user, {k: (c, Path(user, "out", k, "stdout").read_text(),
                      Path(user, "out", k, "stderr").read_text())
                  for k, (c, _) in codes.items()}


@pytest.mark.parametrize("row_id,mode", RUNS, ids=[f"{m}-{r}" for r, m in RUNS])
def test_bad_input_is_one_line(table, row_id, mode):
    user, results = table
    row = {r.id: r for r in TABLE}[row_id]
    code, stdout, stderr = results[f"{mode}_{row_id}"]
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert "Traceback" not in stderr + stdout, stderr[-3000:]
    assert len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith(f"jtrain: {row.kind} error: "), lines[0]
    assert row.line in lines[0], f"\n got: {lines[0]}\nwant: {row.line}"
    assert code == row.code, (code, lines[0])
    run = user / "runs" / f"{mode}_{row_id}"
    assert not list(run.glob("checkpoints/*"))
    metrics = run / "metrics.jsonl"  # a halt at step 1 leaves an empty one
    assert not metrics.exists() or not metrics.read_text().strip()


def test_table_covers_twenty_inputs_with_both_model_apis():
    assert len(TABLE) >= 20
    models = {r.model for r in TABLE}
    assert {"linen", "nnx_model"} <= models
    assert sum("py" in r.modes for r in TABLE) >= 15


def test_the_guide_shows_the_table():
    """docs/guide/troubleshooting.md has a row per bad input: what it is and its line."""
    page = (REPO / "docs" / "guide" / "troubleshooting.md").read_text()
    for row in TABLE:
        assert f"| {row.what} | `jtrain: {row.kind} error: {row.line}" in page, row.id
