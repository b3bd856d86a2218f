"""The eval loop, shared by training and `python -m jtrain.evaluate`.

Eval batches are padded with a validity mask (`jtrain.data.eval_batches`), so every
example counts once and the eval step compiles once. The step returns one batch's metric
states (`jtrain.metrics`, float32 sums on device); they come back a few batches behind
(`MAX_IN_FLIGHT`) and are merged on the host in float64, so the result does not depend on
how the examples were split into batches, devices or processes. Host-side metrics (AUROC,
Spearman) receive this process's rows of each batch and are gathered across processes
once at the end.
"""

from __future__ import annotations

import dataclasses
import re
from collections import deque

import warnings

import jax
import numpy as np

from jtrain import data as data_lib
from jtrain import mesh as mesh_lib
from jtrain import metrics as metrics_lib
from jtrain import step as step_lib
from jtrain.data import checks as data_checks, items as items_lib
from jtrain.errors import ConfigError, JtrainError, first_line

MAX_IN_FLIGHT = 8


@dataclasses.dataclass
class Evaluation:
    scalars: dict[str, float]         # "eval/<name>": value
    arrays: dict[str, np.ndarray]     # "confusion_matrix": int64 [C, C] (true, predicted)
    num_examples: int


def make_spec(eval_cfg, apply_fn, abstract_params, sample_inputs, example: dict, *,
              byte_level: bool = False, with_defaults: bool = False,
              predict_fn=None, model_inputs: tuple = ()) -> metrics_lib.EvalSpec:
    """The metrics to compute (`eval.metrics`, or the task's defaults when empty; both with
    `with_defaults`), from the model's output shape (no arrays are built) and one
    example's targets; with `predict_fn` (eval.predict_fn), from the shapes of the
    predictions and targets it returns. A batch without targets: the loss only."""
    if predict_fn is not None:
        output_shape, targets = predicted_shapes(apply_fn, abstract_params, example,
                                                 predict_fn, model_inputs)
    else:
        output_shape = output_shape_of(apply_fn, abstract_params, sample_inputs)
        targets = (np.asarray(example["targets"]) if "targets" in example
                   and not isinstance(example["targets"], dict) else None)
    t_shape, t_dtype = ((None, np.float32) if targets is None
                        else (tuple(targets.shape), targets.dtype))
    if t_shape is None:  # nothing to compare outputs with: loss (and the loss's terms)
        output_shape, t_shape = None, ()
    names = tuple(eval_cfg.metrics)
    if with_defaults or not names:
        task, num_classes = metrics_lib.infer_task(output_shape, t_shape, t_dtype)
        names = tuple(dict.fromkeys(metrics_lib.default_names(
            task, num_classes, top_k=eval_cfg.top_k, byte_level=byte_level) + names))
    return metrics_lib.EvalSpec.create(output_shape, t_shape, t_dtype, names=names,
                                       top_k=eval_cfg.top_k, max_gathered=eval_cfg.max_gathered,
                                       byte_level=byte_level)


def _example_batch(example: dict, rows: int = 2):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows,) + np.shape(x),
                                                       np.asarray(x).dtype), example)


def predicted_shapes(apply_fn, abstract_params, example, predict_fn, model_inputs=()):
    """(one example's prediction shape, a ShapeDtypeStruct of one example's targets) of
    `predict_fn` (eval.predict_fn), traced on a batch of `example`s."""
    def view(p, b):
        outputs = apply_fn(p, step_lib.inputs_of(b, model_inputs), rng=None, train=False)
        return step_lib.metric_view(outputs, b, predict_fn)

    preds, batch = jax.eval_shape(view, abstract_params, _example_batch(example))
    if not hasattr(preds, "shape") or not hasattr(batch["targets"], "shape"):
        raise data_lib.DataError("eval.predict_fn: must return arrays (predictions, targets"
                                 "[, weights]), got a pytree")
    t = batch["targets"]
    return tuple(preds.shape[1:]), jax.ShapeDtypeStruct(tuple(t.shape[1:]), t.dtype)


def output_shape_of(apply_fn, abstract_params, sample_inputs):
    """One example's output shape (no batch axis), None for a pytree of outputs; a
    DataError when the model cannot be called on these inputs (`traced_outputs`)."""
    out = traced_outputs(apply_fn, abstract_params, sample_inputs)
    return tuple(out.shape[1:]) if hasattr(out, "shape") else None


def check_targets(spec, output_shape, sources: dict, *, default_loss: bool) -> None:
    """DataError (one line, before the first step) for the first batches of each split
    (`sources`: {"train_data": Data, "eval_data": Data}) that would fail later or train
    wrong without an error (jtrain.data.checks): with the default loss, targets it
    cannot score as the model's output implies (integer labels without one output per
    class, float targets holding labels or one-hot rows, float targets of another shape
    than the output, which the MSE would broadcast: [B, 1] against [B]; bool targets); a
    class label outside [0, num_classes) (with a user loss, negative labels are allowed:
    an ignore index); NaN / inf (train: in every example of the first batch, as each
    such batch is skipped; eval: in any example of its first batch)."""
    if default_loss and output_shape is None:
        raise data_lib.DataError(
            "model: it returns a pytree of outputs (e.g. a dict of heads), which the "
            "default loss cannot score; pass loss_fn(outputs, batch)")
    for src in sources.values():
        if default_loss:
            data_checks.check_default_loss_targets(src, output_shape)
        if spec.task in ("classification", "sequence"):
            data_checks.check_labels(src, spec.num_classes, low=0 if default_loss else -np.inf)
    for name, src in sources.items():
        data_checks.check_finite(src, train=not name.startswith("eval"))


def describe_inputs(inputs) -> str:
    """One example's shapes: `float32 (4,)`, or `{image: uint8 (28, 28), n: int32 ()}`."""
    leaves = items_lib.flatten(inputs)
    parts = [f"{np.dtype(x.dtype).name} {tuple(x.shape[1:])}" for _, x in leaves]
    if len(leaves) == 1 and not leaves[0][0]:
        return parts[0]
    return "{" + ", ".join(f"{p.lstrip('.')}: {d}" for (p, _), d in zip(leaves, parts)) + "}"


def traced_outputs(apply_fn, abstract_params, inputs, where: str = "the first batch",
                   model: str = "the model", note: str = ""):
    """The model's outputs on `inputs` (a batch of ShapeDtypeStructs; nothing runs); a
    one-line DataError naming the inputs when calling the model raises or it returns
    None. `note`: said after the error (e.g. the train split's shapes)."""
    try:
        out = jax.eval_shape(lambda p, x: apply_fn(p, x, rng=None, train=False),
                             abstract_params, inputs)
    except JtrainError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's model: its first line, no traceback
        raise model_call_error(e, inputs, where, model, note) from e
    if out is None:
        raise data_lib.DataError(
            f"model: {model} returns None on {where}'s inputs ({describe_inputs(inputs)} "
            "per example); return the outputs the loss scores (e.g. logits [batch, classes])")
    return out


def model_call_error(e: BaseException, inputs, where: str = "the first batch",
                     model: str = "the model", note: str = "") -> data_lib.DataError:
    """The one line for a model that raised when first called (or initialised) on a
    batch of the data's inputs: a shape or dtype the model does not take."""
    return data_lib.DataError(
        f"model: calling {model} on {where}'s inputs ({describe_inputs(inputs)} per "
        f"example) raised {type(e).__name__}: {short_reason(e)}{note}; does it expect "
        "inputs of another shape or dtype? (fix the data, the model's first layer, or "
        "data.model_inputs)")


def short_reason(e: BaseException) -> str:
    """An exception's first line without a trailing link or period, at most 300 chars."""
    text = re.sub(r"\s*\(https?://\S+\)\s*$", "", first_line(e)).rstrip(". ")
    return text[:300]


def check_model_and_loss(apply_fn, loss_fn, abstract_params, examples: dict, *,
                         model_inputs: tuple = (), model: str = "the model") -> None:
    """Before the first step, traced on a batch of 2 of each split's example
    (`examples`: {"train_data": example 0, "eval_data": ...}; shapes only, nothing runs):
    the model takes each split's inputs (eval inputs it cannot take would fail at the
    first eval) and returns something, and a `loss_fn` takes (outputs, batch) and returns
    a scalar mean or (loss_sum, weight_sum), each optionally with a dict of named terms.
    A one-line DataError naming the split, the shapes and the fix."""
    seen = None
    for name, example in examples.items():
        batch = _example_batch(example)
        try:
            inputs = step_lib.inputs_of(batch, model_inputs)
        except KeyError as e:
            raise ConfigError("data.model_inputs", f"{name}: {e.args[0]}") from None
        shapes = describe_inputs(inputs)
        note = f" (train_data's inputs: {seen})" if seen not in (None, shapes) else ""
        outputs = traced_outputs(apply_fn, abstract_params, inputs, name, model, note)
        seen = seen or shapes
        if loss_fn is not None:
            _check_loss(loss_fn, outputs, batch, name)


def _check_loss(loss_fn, outputs, batch, name: str) -> None:
    from jtrain import losses

    returned = []

    def traced(o, b):
        result = loss_fn(o, b)
        returned.append(type(result).__name__)
        return losses.split_loss(result)

    fields = ", ".join(sorted(map(str, batch)))
    what = (f"a batch of {name} (fields {fields}; outputs {describe_inputs(outputs)} per "
            "example)")
    try:
        (loss_sum, weight), terms = jax.eval_shape(traced, outputs, batch)
    except JtrainError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's loss: its first line, no traceback
        if returned:  # it ran; what it returned is not a loss
            raise data_lib.DataError(
                f"loss_fn: returns a {returned[0]} on {what}; return a scalar mean, "
                "(loss_sum, weight_sum), or either with a dict of named terms") from e
        hint = ("; it is called as loss_fn(outputs, batch)"
                if isinstance(e, TypeError) and "argument" in str(e) else "")
        raise data_lib.DataError(f"loss_fn: raised {type(e).__name__}: "
                                 f"{short_reason(e)} on {what}{hint}") from e
    for part, x in [("the loss", loss_sum), ("its weight", weight)] + [
            (f"term {k!r}", v[0]) for k, v in terms.items()]:
        if x.shape != ():
            raise data_lib.DataError(
                f"loss_fn: {part} has shape {tuple(x.shape)} on {what} of 2 examples, not "
                "a scalar; reduce it (e.g. per_example.mean(), or jtrain.losses.weighted("
                "per_example, batch) for (loss_sum, weight_sum))")


def metric_keys(spec, terms=()) -> set[str]:
    """The names ("eval/<name>") an evaluation with `spec` reports, known before any
    eval runs (checked against early_stop / plateau / checkpoint monitors); `terms`:
    the user loss's named terms (`loss_term_names`)."""
    device, host = metrics_lib.make_collection(spec).partition()
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        names = {*device.compute(), *host.compute(), *terms}
    return {f"eval/{k}" for k in names}


def loss_term_names(apply_fn, loss_fn, abstract_params, example: dict,
                    model_inputs: tuple = ()) -> tuple[str, ...]:
    """The names of the terms a user loss returns beside the loss (`(loss, {...})`),
    traced on a batch of `example`s; () for the default loss."""
    if loss_fn is None:
        return ()
    from jtrain import losses

    terms = jax.eval_shape(lambda p, b: losses.split_loss(loss_fn(
        apply_fn(p, step_lib.inputs_of(b, model_inputs), rng=None, train=False), b))[1],
        abstract_params, _example_batch(example))
    return tuple(terms)


def local_rows(x) -> np.ndarray:
    """This process's rows of a batch-sharded global array, in order (replicas once)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    blocks = {}
    for shard in x.addressable_shards:
        start = shard.index[0].start or 0
        if start not in blocks:
            blocks[start] = np.asarray(shard.data)
    return np.concatenate([blocks[k] for k in sorted(blocks)])


def run_eval(eval_step, params, source, *, mesh, local_batch: int, spec, max_batches: int = 0
             ) -> Evaluation:
    """Metrics over every example of `source` (or the first `max_batches` global batches).

    `eval_step` = jit(jtrain.step.make_eval_step(..., metrics=spec)). A collective on
    several processes: every process calls it with its own `local_batch` rows."""
    device_total, host_total = metrics_lib.make_collection(spec).partition()
    pending: deque = deque()

    terms: dict[str, list] = {}  # the loss's named terms: [sum, weight] in float64

    def drain(out):
        nonlocal device_total, host_total
        state, inputs, batch_terms = out
        for name, pair in jax.device_get(batch_terms).items():
            acc = terms.setdefault(name, [0.0, 0.0])
            acc[0] += float(pair[0])
            acc[1] += float(pair[1])
        device_total = device_total.merge(state)  # float64 / int64 on the host
        if host_total.metrics:
            host_total = host_total.update(**{k: local_rows(v) for k, v in inputs.items()})

    batches = data_lib.eval_batches(
        source, local_batch=local_batch, process_index=jax.process_index(),
        process_count=jax.process_count(), max_batches=max_batches)
    for batch in batches:
        pending.append(eval_step(params, mesh_lib.host_to_device(batch, mesh)))
        if len(pending) > MAX_IN_FLIGHT:
            drain(pending.popleft())
    while pending:
        drain(pending.popleft())
    # The device states came from global batches and already cover every process; the
    # host-side buffers hold this process's rows only.
    host_total = metrics_lib.reduce_across_processes(host_total)
    scalars = {**device_total.compute(), **host_total.compute(),
               **{name: (s / w if w > 0 else float("nan")) for name, (s, w) in terms.items()}}
    n = data_lib.num_eval_examples(source, max_batches, local_batch * jax.process_count())
    return Evaluation(scalars={f"eval/{k}": v for k, v in scalars.items()},
                      arrays=device_total.compute_arrays(), num_examples=n)


def headline(scalars: dict) -> str:
    """`loss 1.2340, accuracy 0.6120, ...` for the console: per-class values and the micro
    averages (equal to the accuracy for single-label classes) are left to the files."""
    return ", ".join(f"{k.split('/', 1)[1]} {v:.4f}" for k, v in scalars.items()
                     if k.startswith("eval/") and k.count("/") == 1
                     and not k.endswith("_micro") and isinstance(v, float))


def format_line(step: int, result: Evaluation) -> str:
    """`jtrain: eval at step 500 (925 examples): loss 1.2340, accuracy 0.6120, ...`."""
    return (f"jtrain: eval at step {step} ({result.num_examples:,} examples): "
            + headline(result.scalars))
