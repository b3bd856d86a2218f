"""The pure eval step (`make_eval_step`) and what every step reads of a batch: the
model's inputs (`inputs_of`), the view the metrics compare (`metric_view`)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jtrain import losses
from jtrain import metrics as metrics_lib

ENGINE_KEYS = (losses.ROW_MASK,)


def inputs_of(batch, model_inputs: tuple = ()):
    """What the model is called with: the `model_inputs` fields of the batch (one: that
    array; several: a dict of them), else `batch["inputs"]`, else the whole batch less
    the engine's row mask (a dataset yielding `x_data`, `x_avail`, ... needs no
    restructuring). Works on one example as on a batch."""
    if model_inputs:
        missing = [k for k in model_inputs if k not in batch]
        if missing:
            raise KeyError(f"data.model_inputs: no field {missing[0]!r} in the batch "
                           f"(fields: {', '.join(sorted(map(str, batch)))})")
        if len(model_inputs) == 1:
            return batch[model_inputs[0]]
        return {k: batch[k] for k in model_inputs}
    if "inputs" in batch:
        return batch["inputs"]
    return {k: v for k, v in batch.items() if k not in ENGINE_KEYS}



def make_eval_step(apply_fn: Callable, loss_fn: Callable, *, user_loss: bool,
                   metrics: metrics_lib.EvalSpec | None = None, model_inputs: tuple = (),
                   predict_fn: Callable | None = None, batch_loss: bool = False,
                   forward: Callable | None = None) -> Callable:
    """Returns eval_step(params, batch) -> sums {loss_sum, weight[, correct, counted]}, or
    with `metrics` (a jtrain.metrics.EvalSpec) -> (state, inputs, terms): the jittable
    metric states of this batch (a MetricCollection; merge them on the host in float64),
    when the spec has host-side metrics (AUROC, Spearman) their batch inputs, else {},
    and the user loss's named terms {name: (sum, weight)} (`losses.split_loss`).

    Rows with row mask 0 (padding, `losses.ROW_MASK`) contribute nothing. The default
    loss honours the mask itself. A user loss is evaluated one example at a time
    (vmapped) and masked here, so a user loss that returns a mean is still exact under
    padding; with `batch_loss` it is called once on the whole batch (the only way to
    score a loss defined over the batch, such as a correlation): the evaluator gives it
    batches without padding (a partial batch at its true size), and a mean it returns
    counts once per row, so batch means average weighted by their row counts. `predict_fn(outputs,
    batch) -> (predictions, targets[, weights])` is what the metrics compare.
    `forward(params, batch) -> outputs` replaces the model call (a step of your own: its
    `evaluate(state, batch)`, given the batch without the engine's keys).

    Examples:
        ```python
        ev = jax.jit(jtrain.make_eval_step(model_fns.apply, losses.default_loss,
                                           user_loss=False))
        sums = ev(state.params, batch)  # loss_sum / weight, correct / counted
        ```
    """
    device_metrics = (None if metrics is None
                      else metrics_lib.make_collection(metrics).partition()[0])

    def eval_step(params, batch):
        if forward is not None:
            outputs = forward(params, {k: v for k, v in batch.items()
                                       if k not in ENGINE_KEYS})
        else:
            outputs = apply_fn(params, inputs_of(batch, model_inputs), rng=None, train=False)
        terms = {}
        if user_loss and not batch_loss:
            rows_n = losses.batch_rows(batch)
            mask = losses.row_mask(batch)
            mask = jnp.ones(rows_n, jnp.float32) if mask is None else mask
            # Output leaves without the batch axis (a scalar regulariser) go whole to
            # every example: a mean over examples then adds them once, as in training.
            per_row = jax.tree.map(lambda o: jnp.ndim(o) > 0 and o.shape[0] == rows_n,
                                   outputs)

            def one(out, ex):
                ex = jax.tree.map(lambda x: x[None], ex)
                out = jax.tree.map(lambda o, b: o[None] if b else o, out, per_row)
                return losses.split_loss(loss_fn(out, ex))

            rows = {k: v for k, v in batch.items() if k not in ENGINE_KEYS}
            in_axes = (jax.tree.map(lambda b: 0 if b else None, per_row), 0)
            (ls, ws), per_terms = jax.vmap(one, in_axes=in_axes)(outputs, rows)  # [B] each
            keep = mask > 0  # `where`, not a product: a NaN in a padded row must not leak

            def masked(x):
                return jnp.where(keep, x * mask, 0.0).sum()

            sums = {"loss_sum": masked(ls), "weight": masked(ws)}
            terms = {k: (masked(s), masked(w)) for k, (s, w) in per_terms.items()}
        elif user_loss:  # batch scope: a batch without padding (`jtrain.engine.evaluation`)
            (loss_sum, weight), terms = losses.split_loss(loss_fn(outputs, batch),
                                                          rows=losses.batch_rows(batch))
            sums = {"loss_sum": loss_sum, "weight": weight}
        else:
            loss_sum, weight = losses.default_loss(outputs, batch)
            sums = {"loss_sum": loss_sum, "weight": weight}
        if metrics is not None:
            m_outputs, m_batch = metric_view(outputs, batch, predict_fn)
            state = metrics_lib.update_from_outputs(device_metrics, m_outputs, m_batch,
                                                    sums["loss_sum"], sums["weight"], metrics)
            return state, (metrics_lib.metric_batch(m_outputs, m_batch, metrics)
                           if metrics.gathers else {}), terms
        hits = losses.correct_count(outputs, batch)
        if hits is not None:
            sums["correct"], sums["counted"] = hits
        return sums

    return eval_step


def metric_view(outputs, batch, predict_fn: Callable | None = None):
    """(predictions, batch) the metrics read: the outputs and the batch as they are, or
    `predict_fn`'s predictions with its targets (and weights, if it returns them) in
    place of the batch's."""
    if predict_fn is None:
        return outputs, batch
    result = predict_fn(outputs, batch)
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise TypeError("eval.predict_fn: must return (predictions, targets) or "
                        f"(predictions, targets, weights), got {type(result).__name__}")
    view = {"targets": result[1]}
    if len(result) == 3:
        view["weights"] = result[2]
    rows = losses.row_mask(batch)
    if rows is not None:
        view[losses.ROW_MASK] = rows
    return result[0], view
