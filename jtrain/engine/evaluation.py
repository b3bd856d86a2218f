"""The eval pass, shared by training and `python -m jtrain.evaluate`.

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
import warnings
from collections import deque

import jax
import numpy as np
from jax.experimental import multihost_utils

from jtrain import data as data_lib
from jtrain import losses
from jtrain import mesh as mesh_lib
from jtrain import metrics as metrics_lib
from jtrain import state as state_lib
from jtrain import step as step_lib
from jtrain.engine.checks import example_batch, output_shape_of

MAX_IN_FLIGHT = 8


@dataclasses.dataclass
class Evaluation:
    scalars: dict[str, float]         # "eval/<name>": value
    # "confusion_matrix": float64 [C, C] (true, predicted), summed example weights
    arrays: dict[str, np.ndarray]
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


def predicted_shapes(apply_fn, abstract_params, example, predict_fn, model_inputs=()):
    """(one example's prediction shape, a ShapeDtypeStruct of one example's targets) of
    `predict_fn` (eval.predict_fn), traced on a batch of `example`s."""
    def view(p, b):
        outputs = apply_fn(p, step_lib.inputs_of(b, model_inputs), rng=None, train=False)
        return step_lib.metric_view(outputs, b, predict_fn)

    preds, batch = jax.eval_shape(view, abstract_params, example_batch(example))
    if not hasattr(preds, "shape") or not hasattr(batch["targets"], "shape"):
        raise data_lib.DataError("eval.predict_fn: must return arrays (predictions, targets"
                                 "[, weights]), got a pytree")
    t = batch["targets"]
    return tuple(preds.shape[1:]), jax.ShapeDtypeStruct(tuple(t.shape[1:]), t.dtype)


# eval.weights: which parameters an evaluation scores, and the prefix of their metrics.
PREFIXES = {"params": "eval/", "ema": "eval/ema/"}


def weight_sets(weights: str) -> tuple[str, ...]:
    """eval.weights -> the parameter sets evaluated ("both": params, then the EMA)."""
    return ("params", "ema") if weights == "both" else (weights,)


def metric_keys(spec, terms=(), weights: str = "params") -> set[str]:
    """The names ("eval/<name>", the EMA's "eval/ema/<name>") an evaluation with
    `spec` reports, known before any eval runs (checked against early_stop / plateau /
    checkpoint monitors); `terms`: the user loss's named terms
    (`jtrain.engine.checks.loss_term_names`); `weights`: eval.weights."""
    device, host = metrics_lib.make_collection(spec).partition()
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        names = {*device.compute(), *host.compute(), *terms}
    return {PREFIXES[w] + k for w in weight_sets(weights) for k in names}


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


def real_rows(batch: dict) -> dict | None:
    """The real rows of the global batch, when any of its rows is padding (None when none
    is), on every process alike: the rows of all processes in process order, less the
    padding and the row mask."""
    mask = batch.get(losses.ROW_MASK)
    if mask is None:
        return None
    if jax.process_count() > 1:  # the decision and the rows must agree on every process
        mask = np.asarray(multihost_utils.process_allgather(mask, tiled=True))
    if mask.all():
        return None
    fields = {k: v for k, v in batch.items() if k != losses.ROW_MASK}
    if jax.process_count() > 1:
        fields = multihost_utils.process_allgather(fields, tiled=True)
    keep = np.asarray(mask) > 0
    return jax.tree.map(lambda x: np.asarray(x)[keep], fields)


def run_eval(eval_step, params, source, *, mesh, local_batch: int, spec, max_batches: int = 0,
             tail_step=None) -> Evaluation:
    """Metrics over every example of `source` (or the first `max_batches` global batches).

    `eval_step` = jit(jtrain.step.make_eval_step(..., metrics=spec)). A collective on
    several processes: every process calls it with its own `local_batch` rows.
    `tail_step` (a loss scored over the whole batch, loss.eval_scope=batch): the same
    step jitted for replicated batches; a batch holding padding is then scored at its
    true size, its real rows only, so padding never reaches the loss."""
    device_total, host_total = metrics_lib.make_collection(spec).partition()
    pending: deque = deque()
    terms: dict[str, list] = {}  # the loss's named terms: [sum, weight] in float64
    batches = data_lib.eval_batches(
        source, local_batch=local_batch, process_index=jax.process_index(),
        process_count=jax.process_count(), max_batches=max_batches)
    for batch in batches:
        if tail_step is not None:
            real = real_rows(batch)
            if real is not None:
                if jax.tree.leaves(real)[0].shape[0]:
                    pending.append(tail_step(params, jax.device_put(
                        real, mesh_lib.replicated(mesh))))
                continue
        pending.append(eval_step(params, mesh_lib.host_to_device(batch, mesh)))
        if len(pending) > MAX_IN_FLIGHT:
            device_total, host_total = _merged(device_total, host_total, terms,
                                               pending.popleft())
    while pending:
        device_total, host_total = _merged(device_total, host_total, terms, pending.popleft())
    # The device states came from global batches and already cover every process; the
    # host-side buffers hold this process's rows only.
    host_total = metrics_lib.reduce_across_processes(host_total)
    scalars = {**device_total.compute(), **host_total.compute(),
               **{name: (s / w if w > 0 else float("nan")) for name, (s, w) in terms.items()}}
    n = data_lib.num_eval_examples(source, max_batches, local_batch * jax.process_count())
    return Evaluation(scalars={f"eval/{k}": v for k, v in scalars.items()},
                      arrays=device_total.compute_arrays(), num_examples=n)


def _merged(device_total, host_total, terms: dict, out):
    """One eval step's output merged into the totals (returned) and the loss's named
    terms (`terms`, updated)."""
    state, inputs, batch_terms = out
    for name, pair in jax.device_get(batch_terms).items():
        acc = terms.setdefault(name, [0.0, 0.0])
        acc[0] += float(pair[0])
        acc[1] += float(pair[1])
    device_total = device_total.merge(state)  # float64 / int64 on the host
    if host_total.metrics:
        host_total = host_total.update(**{k: local_rows(v) for k, v in inputs.items()})
    return device_total, host_total


def evaluate_weights(eval_step, state, source, *, weights: str = "params", **kwargs
                     ) -> Evaluation:
    """`run_eval` of the params, the weight EMA or both (`weights`: eval.weights; the
    parameters come from `jtrain.state.eval_params`). The EMA's metrics are named
    `eval/ema/<name>`, its arrays `ema_<name>` (`ema_confusion_matrix`)."""
    scalars, arrays, n = {}, {}, 0
    for which in weight_sets(weights):
        result = run_eval(eval_step, state_lib.eval_params(state, which), source, **kwargs)
        prefix = PREFIXES[which]
        scalars.update({prefix + k.removeprefix("eval/"): v for k, v in result.scalars.items()})
        arrays.update({("" if which == "params" else f"{which}_") + k: v
                       for k, v in result.arrays.items()})
        n = result.num_examples
    return Evaluation(scalars=scalars, arrays=arrays, num_examples=n)


def headline(scalars: dict) -> str:
    """`loss 1.2340, accuracy 0.6120, ...` for the console (the EMA's as `ema/loss ...`):
    per-class values and the micro averages (equal to the accuracy for single-label
    classes) are left to the files."""
    return ", ".join(f"{k.split('/', 1)[1]} {v:.4f}" for k, v in scalars.items()
                     if k.startswith("eval/")
                     and "/" not in k.removeprefix("eval/").removeprefix("ema/")
                     and not k.endswith("_micro") and isinstance(v, float))


def format_line(step: int, result: Evaluation) -> str:
    """`jtrain: eval at step 500 (925 examples): loss 1.2340, accuracy 0.6120, ...`."""
    return (f"jtrain: eval at step {step} ({result.num_examples:,} examples): "
            + headline(result.scalars))
