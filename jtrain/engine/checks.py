"""The training pre-flight checks of the model and the loss: before the first step,
traced on shapes only (nothing runs), the model takes each split's inputs, returns
something the loss can score, and the loss returns a scalar (or a sum and a weight),
optionally with named terms; the first batches' targets suit the model's output
(`jtrain.data.checks`). Each failure is one line naming the split, the shapes and
the fix.
"""

from __future__ import annotations

import re
import weakref

import jax
import numpy as np

from jtrain import data as data_lib
from jtrain import step as step_lib
from jtrain.data import checks as data_checks
from jtrain.data import items as items_lib
from jtrain.errors import ConfigError, JtrainError, first_line


def example_batch(example: dict, rows: int = 2):
    """A batch of `rows` copies of `example`, as ShapeDtypeStructs."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows,) + np.shape(x),
                                                       np.asarray(x).dtype), example)


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
            data_checks.check_weights(src)
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
    return "{" + ", ".join(f"{p.lstrip('.')}: {d}"
                           for (p, _), d in zip(leaves, parts, strict=True)) + "}"


def traced_outputs(apply_fn, abstract_params, inputs, where: str = "the first batch",
                   model: str = "the model", note: str = ""):
    """The model's outputs on `inputs` (a batch of ShapeDtypeStructs; nothing runs); a
    one-line DataError naming the inputs when calling the model raises or it returns
    None. `note`: said after the error (e.g. the train split's shapes). The same model
    on the same shapes is traced once per process (build's checks and the eval's metric
    choice ask for the same outputs)."""
    seen = _traced_by(apply_fn)
    key = _trace_key(abstract_params, inputs) if seen is not None else None
    if key is not None and key in seen:
        return seen[key]
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
    if key is not None:
        seen[key] = out
    return out


# apply_fn -> {(params' and inputs' shapes): the outputs traced}; held while apply_fn lives.
_TRACED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _traced_by(apply_fn) -> dict | None:
    """The outputs traced so far for `apply_fn`; None when it cannot be held weakly."""
    try:
        return _TRACED.setdefault(apply_fn, {})
    except TypeError:
        return None


def _trace_key(abstract_params, inputs) -> tuple | None:
    """What eval_shape's outputs depend on: the trees' structures, each leaf's shape,
    dtype and weak type; None when a leaf is not an array or its spec (no reuse)."""
    try:
        key = tuple((jax.tree.structure(t),
                     tuple((tuple(x.shape), x.dtype, bool(getattr(x, "weak_type", False)))
                           for x in jax.tree.leaves(t)))
                    for t in (abstract_params, inputs))
        hash(key)
    except (AttributeError, TypeError):
        return None
    return key


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
    seen, traced = None, {}  # a split whose inputs match one traced already: its outputs
    for name, example in examples.items():
        batch = example_batch(example)
        try:
            inputs = step_lib.inputs_of(batch, model_inputs)
        except KeyError as e:
            raise ConfigError("data.model_inputs", f"{name}: {e.args[0]}") from None
        shapes = describe_inputs(inputs)
        note = f" (train_data's inputs: {seen})" if seen not in (None, shapes) else ""
        key = _signature(inputs)
        if key not in traced:
            traced[key] = traced_outputs(apply_fn, abstract_params, inputs, name, model, note)
        outputs = traced[key]
        seen = seen or shapes
        if loss_fn is not None:
            _check_loss(loss_fn, outputs, batch, name)


def _signature(tree) -> tuple:
    """A pytree of arrays or ShapeDtypeStructs by its structure, shapes and dtypes: equal
    signatures trace the same."""
    return (jax.tree.structure(tree),
            tuple((tuple(x.shape), np.dtype(x.dtype)) for x in jax.tree.leaves(tree)))


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


def loss_term_names(apply_fn, loss_fn, abstract_params, example: dict,
                    model_inputs: tuple = ()) -> tuple[str, ...]:
    """The names of the terms a user loss returns beside the loss (`(loss, {...})`),
    traced on a batch of `example`s; () for the default loss."""
    if loss_fn is None:
        return ()
    from jtrain import losses

    terms = jax.eval_shape(lambda p, b: losses.split_loss(loss_fn(
        apply_fn(p, step_lib.inputs_of(b, model_inputs), rng=None, train=False), b))[1],
        abstract_params, example_batch(example))
    return tuple(terms)
