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
from collections import deque

import warnings

import jax
import numpy as np

from jtrain import data as data_lib
from jtrain import mesh as mesh_lib
from jtrain import metrics as metrics_lib

MAX_IN_FLIGHT = 8


@dataclasses.dataclass
class Evaluation:
    scalars: dict[str, float]         # "eval/<name>": value
    arrays: dict[str, np.ndarray]     # "confusion_matrix": int64 [C, C] (true, predicted)
    num_examples: int


def make_spec(eval_cfg, apply_fn, abstract_params, sample_inputs, example: dict, *,
              byte_level: bool = False, with_defaults: bool = False) -> metrics_lib.EvalSpec:
    """The metrics to compute (`eval.metrics`, or the task's defaults when empty; both with
    `with_defaults`), from the model's output shape (no arrays are built) and one
    example's targets."""
    output_shape = output_shape_of(apply_fn, abstract_params, sample_inputs)
    targets = np.asarray(example["targets"])
    names = tuple(eval_cfg.metrics)
    if with_defaults or not names:
        task, num_classes = metrics_lib.infer_task(output_shape, targets.shape, targets.dtype)
        names = tuple(dict.fromkeys(metrics_lib.default_names(
            task, num_classes, top_k=eval_cfg.top_k, byte_level=byte_level) + names))
    return metrics_lib.EvalSpec.create(output_shape, targets.shape, targets.dtype, names=names,
                                       top_k=eval_cfg.top_k, max_gathered=eval_cfg.max_gathered,
                                       byte_level=byte_level)


def output_shape_of(apply_fn, abstract_params, sample_inputs):
    """One example's output shape (no batch axis), None for a pytree of outputs."""
    out = jax.eval_shape(lambda p, x: apply_fn(p, x, rng=None, train=False),
                         abstract_params, sample_inputs)
    return tuple(out.shape[1:]) if hasattr(out, "shape") else None


TARGET_SCAN = 256  # examples of each split whose targets are checked before step 1


def check_targets(spec, output_shape, sources: dict, *, default_loss: bool) -> None:
    """DataError (one line, before the first step) for targets that would train wrong
    without an error: a class label outside [0, num_classes) (with a user loss, negative
    labels are allowed: an ignore index), or, with the default loss, regression targets
    whose shape differs from the output's (the MSE would broadcast [B, 1] against [B])."""
    if default_loss and output_shape is None:
        raise data_lib.DataError(
            "model: it returns a pytree of outputs (e.g. a dict of heads), which the "
            "default loss cannot score; pass loss_fn(outputs, batch)")
    if default_loss and output_shape is not None:
        for name, src in sources.items():
            targets = np.asarray(src[0]["targets"])
            shape = targets.shape
            if np.issubdtype(targets.dtype, np.integer) and \
                    tuple(output_shape[:-1]) != tuple(shape):
                raise data_lib.DataError(
                    f"{name}: integer targets (class labels) of shape {tuple(shape)} per "
                    f"example need model outputs of shape {tuple(shape)} + (classes,), got "
                    f"{tuple(output_shape)}; fix the targets or the model's output, or "
                    "pass a loss_fn")
            if np.issubdtype(targets.dtype, np.floating) and \
                    tuple(shape) != tuple(output_shape):
                raise data_lib.DataError(
                    f"{name}: targets of shape {tuple(shape)} per example against model "
                    f"outputs of shape {tuple(output_shape)}: the default MSE would "
                    "broadcast them; reshape the targets (or the output) to match, or pass "
                    "a loss_fn")
    if spec.task not in ("classification", "sequence"):
        return
    low = 0 if default_loss else -np.inf
    for name, src in sources.items():
        n = min(len(src), TARGET_SCAN) if hasattr(src, "__len__") else 1
        for i in range(n):
            example = src[i]
            labels = np.asarray(example["targets"])
            if "weights" in example:  # a label with weight 0 is never used
                labels = labels[np.broadcast_to(np.asarray(example["weights"]) > 0,
                                                labels.shape)]
            bad = labels[(labels < low) | (labels >= spec.num_classes)]
            if bad.size:
                raise data_lib.DataError(
                    f"{name}: example {i} has class label {int(bad.flat[0])}, outside "
                    f"0..{spec.num_classes - 1} (the model has {spec.num_classes} outputs); "
                    "fix the labels, give the model more outputs, or give such labels "
                    "weight 0 (batch['weights'])")


def metric_keys(spec, terms=()) -> set[str]:
    """The names ("eval/<name>") an evaluation with `spec` reports, known before any
    eval runs (checked against early_stop / plateau / checkpoint monitors); `terms`:
    the user loss's named terms (`loss_term_names`)."""
    device, host = metrics_lib.make_collection(spec).partition()
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        names = {*device.compute(), *host.compute(), *terms}
    return {f"eval/{k}" for k in names}


def loss_term_names(apply_fn, loss_fn, abstract_params, example: dict) -> tuple[str, ...]:
    """The names of the terms a user loss returns beside the loss (`(loss, {...})`),
    traced on one example's shapes; () for the default loss."""
    if loss_fn is None:
        return ()
    from jtrain import losses

    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct((1,) + np.shape(x),
                                                        np.asarray(x).dtype), example)
    terms = jax.eval_shape(lambda p, b: losses.split_loss(loss_fn(
        apply_fn(p, b["inputs"], rng=None, train=False), b))[1], abstract_params, batch)
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
