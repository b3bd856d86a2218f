"""Bad input from research code is caught before the first step, in one line.

CASES is a table of inputs research users get wrong. Each row names the user's data,
model and loss functions in a small user module (tests/projects/bad_input_user.py,
copied to a temp dir, with `cfg.py` beside it), the error kind and the start of the one
line jtrain must say, and a piece of that line giving the fix. Each row runs twice:

* from Python, as research code calls it: `jtrain.train(config, workdir, model=...,
  train_data=..., eval_data=..., loss_fn=...)` with the objects the user module builds.
  The exception is the row's kind of JtrainError, its message one line, nothing is
  printed with a traceback and nothing trained (no checkpoint, no metrics.jsonl);
* from the CLI, in this process: `jtrain.main.cli(["--config=cfg.py:<row>",
  "--workdir=..."])`, the same functions named by data.source, model.factory and
  loss.fn. Exit 2, stderr's only error line is `jtrain: <kind> error: <message>`, no
  traceback.

The real entry point, `python -m jtrain.main --config=cfg.py:<row> --workdir=runs/<row>`
run from the temp dir with relative paths and PYTHONPATH = that dir only, runs for
SUBPROCESS_CASES: one row per distinct path to the one line (the data checks, the
targets checks, non-finite values, the model meeting the data, a config's model
factory), all at once, so that the suite stays fast. Rows named accepted_* are inputs
jtrain takes (the policy they pin is in the row's comment).

Non-finite policy (jtrain.data.checks.check_finite): training skips a batch holding an
example with NaN / inf (logged in WORKDIR/skipped.jsonl), so the train split fails only
when every example of its first batch has one; eval skips nothing, so one is enough.
"""

from __future__ import annotations

import copy
import importlib
import os
import subprocess
import sys

import pytest

import jtrain
from jtrain import errors
from jtrain import main as main_lib
from journey import copy_project

CONFIG = '''
from jtrain.config import defaults

CASES = {cases!r}


def get_config(case):
    data, model, loss, over = CASES[case]
    c = defaults("user")
    c.total_steps = 2
    c.data.batch_size = 8
    c.data.val_fraction = 0.0
    c.eval.every_steps = 1
    c.log.verbosity = 0
    c.checkpoint.every_steps = 0
    if data:
        c.data.source = "bad_input_user:" + data
    if model:
        c.model.factory = "bad_input_user:" + model
    if loss:
        c.loss.fn = "bad_input_user:" + loss
    for section, values in over.items():
        for key, value in values.items():
            c[section][key] = value
    return c
'''

# (row, data fn, model fn, loss fn, config overrides, kind, start of the message, a piece
# of it that gives the fix). A None data / model fn: the config names it (overrides).
# kind None: accepted (trains).
CASES = [
    ("labels_minus_one", "labels_minus_one", "classifier", None, {}, "data",
     "train_data: example 5 has class label -1, outside 0..2 (the model has 3 outputs)",
     "give such labels weight 0"),
    ("eval_label_out_of_range", "eval_label_out_of_range", "classifier", None, {}, "data",
     "eval_data: example 11 has class label 3, outside 0..2", "fix the labels"),
    ("label_out_of_range_late", "late_label", "classifier", None, {}, "data",
     "train_data: example 300 has class label 5, outside 0..2", "fix the labels"),
    ("labels_one_based", "labels_one_based", "classifier", None, {}, "data",
     "train_data: example 2 has class label 3, outside 0..2", "look 1-based"),
    ("float_labels", "float_labels", "classifier", None, {}, "data",
     "train_data: float targets that hold class labels (0.0, 1.0, 2.0, ...) against 3 "
     "model outputs per example", "cast them to np.int32"),
    ("int_regression_targets", "int_regression_targets", "regressor",
     None, {"model": {"kwargs": {"squeeze": True}}}, "data",
     "train_data: integer targets (class labels) of shape () per example need model "
     "outputs of shape () + (classes,), got ()", "cast the targets to np.float32"),
    ("binary_labels_one_output", "binary_labels", "regressor", None, {}, "data",
     "train_data: integer targets (class labels) against 1 model output per example",
     "2 for labels 0/1"),
    ("targets_b_vs_outputs_b1", "regression_b", "regressor", None, {}, "data",
     "train_data: targets of shape () per example against model outputs of shape (1,): "
     "the default MSE would broadcast them", "reshape the targets"),
    ("targets_2_vs_outputs_3", "regression_two", "regressor", None,
     {"model": {"kwargs": {"width": 3}}}, "data",
     "train_data: targets of shape (2,) per example against model outputs of shape (3,)",
     "reshape the targets"),
    ("one_hot_targets", "one_hot", "classifier", None, {}, "data",
     "train_data: targets are one-hot rows of 3 (float)", "np.argmax(targets, -1)"),
    ("bool_targets", "bool_targets", "classifier", None,
     {"model": {"kwargs": {"classes": 2}}}, "data",
     "train_data: targets are bool (shape () per example)", "cast them to np.int32"),
    ("nan_feature_column", "missing_column", "classifier", None, {}, "data",
     "train_data: all 8 examples of the first batch hold NaN or inf (inputs: 8 of 8; "
     "example 0 has nan in inputs)", "impute missing values"),
    ("log_of_zero_targets", "log_counts", "regressor", None, {}, "data",
     "train_data: all 8 examples of the first batch hold NaN or inf (targets: 8 of 8; "
     "example 0 has -inf in targets)", "replace them"),
    ("nan_in_eval", "eval_nan", "classifier", None, {}, "data",
     "eval_data: example 3 has nan in inputs (1 of the first 8 eval examples", "drop such"),
    ("strings_in_items", "strings", "classifier", None, {}, "data",
     "train_data[0].inputs: <U8 values (str) cannot go to a device", "items must hold numbers"),
    ("none_target", "none_targets", "classifier", None, {}, "data",
     "train_data[0].targets: object values (NoneType) cannot go to a device", "numbers"),
    ("ragged_items", "ragged", "classifier", None, {}, "data",
     "train_data[16].inputs: shape (5,) differs from item 0's (4,)", "(4,)"),
    ("shorter_than_a_batch", "too_short", "classifier", None, {}, "data",
     "train_data: 5 examples is fewer than one global batch (data.batch_size=8)",
     "data.batch_size"),
    ("empty_dataset", "empty", "classifier", None, {}, "data",
     "train_data: the dataset is empty", "empty"),
    ("getitem_raises", "getitem_raises", "classifier", None, {}, "data",
     "train_data[0]: KeyError: 'img0.png'", "img0.png"),
    ("model_wants_other_features", "clean", "linear5", None, {}, "data",
     "model: calling the model on the first batch's inputs (float32 (4,) per example) "
     "raised TypeError: dot_general requires contracting dimensions to have the same "
     "shape, got (4,) and (5,)", "does it expect inputs of another shape"),
    ("model_reshapes_to_images", "clean", "image_net", None, {}, "data",
     "model: calling ImageNet on the first batch's inputs (float32 (4,) per example) "
     "raised TypeError: cannot reshape array", "does it expect inputs of another shape"),
    ("eval_inputs_wider", "eval_wider", "classifier", None, {}, "data",
     "model: calling Classifier on eval_data's inputs (float32 (5,) per example) raised",
     "(train_data's inputs: float32 (4,))"),
    ("model_returns_tuple", "clean", "with_features", None, {}, "data",
     "model: it returns a pytree of outputs (e.g. a dict of heads)", "pass loss_fn"),
    ("model_returns_none", "clean", "forgets", None, {}, "data",
     "model: the model returns None on the first batch's inputs (float32 (4,) per "
     "example)", "return the outputs the loss scores"),
    ("loss_per_example", "clean", "classifier", "loss_per_example", {}, "data",
     "loss_fn: the loss has shape (2,) on a batch of train_data (fields inputs, targets; "
     "outputs float32 (3,) per example) of 2 examples, not a scalar", "per_example.mean()"),
    ("loss_one_argument", "clean", "classifier", "loss_one_arg", {}, "data",
     "loss_fn: raised TypeError: loss_one_arg() takes 1 positional argument but 2 were "
     "given on a batch of train_data", "called as loss_fn(outputs, batch)"),
    ("loss_wrong_field", "clean", "classifier", "loss_wrong_field", {}, "data",
     "loss_fn: raised KeyError: 'label' on a batch of train_data (fields inputs, targets; "
     "outputs float32 (3,) per example)", "fields inputs, targets"),
    ("data_source_raises", None, "classifier", None,
     {"data": {"source": "bad_input_user:factory_raises"}}, "data",
     "data.source: bad_input_user:factory_raises(**data.kwargs): FileNotFoundError: "
     "data/train.npz", "data/train.npz"),
    ("model_factory_missing_module", "clean", None, None,
     {"model": {"factory": "bad_input_models:build"}}, "config",
     "model.factory: cannot import 'bad_input_models'", "is it on PYTHONPATH?"),
    ("model_kwargs_typo", "clean", None, None,
     {"model": {"factory": "bad_input_user:classifier", "kwargs": {"clases": 3}}}, "config",
     "model.kwargs: bad_input_user:classifier(**{'clases': 3}) raised TypeError",
     "unexpected keyword argument 'clases'"),
    # Accepted: one NaN example in a batch skips that batch's update (logged); torch
    # tensors that require grad are detached; a tuple of outputs with a loss that
    # reads it; a classifier's stream with a __len__ (its labels were once read by
    # index, which a stream refused in a misleading line).
    ("accepted_some_nan_rows", "some_nan_rows", "classifier", None, {}, None, "", ""),
    ("accepted_requires_grad", "torch_requires_grad", "classifier", None, {}, None, "", ""),
    ("accepted_tuple_with_loss", "clean", "with_features", "loss_with_aux", {}, None, "", ""),
    ("accepted_stream_with_len", "stream_with_len", "classifier", None, {}, None, "", ""),
]

# One row per distinct path to the one line, for the real `python -m jtrain.main`.
SUBPROCESS_CASES = ["getitem_raises", "eval_label_out_of_range", "nan_feature_column",
                    "model_wants_other_features", "model_kwargs_typo"]

BASE = {"total_steps": 2, "data": {"batch_size": 8, "val_fraction": 0.0},
        "eval": {"every_steps": 1}, "log": {"verbosity": 0}, "checkpoint": {"every_steps": 0}}
ROWS = {row[0]: row for row in CASES}





@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    """The temp dir holding bad_input_user.py and cfg.py, importable while the tests run."""
    d = tmp_path_factory.mktemp("user")
    copy_project(d, "bad_input_user")
    table = {r: (data, model, loss, over) for r, data, model, loss, over, *_ in CASES}
    (d / "cfg.py").write_text(CONFIG.format(cases=table))
    sys.path.insert(0, str(d))
    yield d
    sys.path.remove(str(d))
    sys.modules.pop("bad_input_user", None)


def _python_call(row: str):
    """What research code passes to jtrain.train for this row."""
    _, data, model, loss, over, *_ = ROWS[row]
    user = importlib.import_module("bad_input_user")
    config = copy.deepcopy(BASE)
    for section, values in over.items():
        if section != "model":
            config.setdefault(section, {}).update(values)
    model_over = over.get("model", {})
    if model is None:  # the config names it
        config["model"] = {"name": "user", **model_over}
    train_data = eval_data = None
    if data is not None:
        made = getattr(user, data)()
        train_data, eval_data = (made["train"], made.get("eval")) if isinstance(made, dict) \
            and "train" in made else (made, None)
    return dict(config=config,
                model=getattr(user, model)(**model_over.get("kwargs", {})) if model else None,
                train_data=train_data, eval_data=eval_data,
                loss_fn=getattr(user, loss) if loss else None)


def _expect_line(line: str, row: str) -> None:
    _, _, _, _, _, kind, start, fix = ROWS[row]
    prefix = f"jtrain: {kind} error: "
    assert line.startswith(prefix + start), f"\n got: {line}\nwant: {prefix + start}"
    assert fix in line, f"{fix!r} not in {line!r}"


def _nothing_trained(workdir) -> None:
    assert not (workdir / "checkpoints").exists(), sorted(os.listdir(workdir))
    assert not (workdir / "metrics.jsonl").exists(), sorted(os.listdir(workdir))


@pytest.mark.parametrize("row", list(ROWS))
def test_from_python(row, user_dir, tmp_path, capfd):
    call = _python_call(row)
    workdir = tmp_path / "run"
    capfd.readouterr()
    if ROWS[row][5] is None:
        assert jtrain.train(workdir=str(workdir), **call).summary["step"] == 2
        return
    with pytest.raises(errors.JtrainError) as e:
        jtrain.train(workdir=str(workdir), **call)
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err, err
    assert e.value.kind == ROWS[row][5] and e.value.exit_code == 2
    assert "\n" not in str(e.value), str(e.value)
    _expect_line(errors.render(e.value), row)
    _nothing_trained(workdir)


@pytest.mark.parametrize("row", list(ROWS))
def test_from_the_cli(row, user_dir, tmp_path, capfd):
    workdir = tmp_path / "run"
    argv = ["jtrain", f"--config={user_dir}/cfg.py:{row}", f"--workdir={workdir}"]
    capfd.readouterr()
    if ROWS[row][5] is None:
        main_lib.cli(argv)
        assert "Traceback" not in "".join(capfd.readouterr())
        return
    with pytest.raises(SystemExit) as e:
        main_lib.cli(argv)
    out, err = capfd.readouterr()
    assert e.value.code == 2, err
    assert "Traceback" not in out + err, err
    lines = [ln for ln in err.splitlines() if " error: " in ln]
    assert len(lines) == 1, err
    _expect_line(lines[0], row)
    _nothing_trained(workdir)


def test_the_real_entry_point(user_dir):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=".")  # the user's module beside the config
    procs = {row: subprocess.Popen(
        [sys.executable, "-m", "jtrain.main", f"--config=cfg.py:{row}",
         f"--workdir=runs/{row}"], cwd=user_dir, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for row in SUBPROCESS_CASES}
    for row, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, f"{row}: {err[-3000:]}"
        assert "Traceback" not in out + err, err
        lines = [ln for ln in err.splitlines() if " error: " in ln]
        assert len(lines) == 1, err
        _expect_line(lines[0], row)
        _nothing_trained(user_dir / "runs" / row)


def test_table_is_large_and_runs_every_path():
    bad = [r for r in CASES if r[5] is not None]
    assert len(bad) >= 20
    assert set(SUBPROCESS_CASES) <= set(ROWS)
