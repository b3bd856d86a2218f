"""`build()`: the set-up that training, `python -m jtrain.evaluate` and the benchmarks
share — model (built-in, `model.factory` or yours, LoRA-wrapped when configured), mesh,
optimizer, loss (yours, `loss.fn` or `loss.terms`), abstract state, shardings and the
jitted steps — before the first array exists, read top-down: each line a helper of
jtrain.engine.parts with its inputs as arguments and its outputs as return values.
`check_run`: the checks that call the model before the first step.
"""

from __future__ import annotations

from typing import Callable

from jtrain import data as data_lib
from jtrain import mesh as mesh_lib
from jtrain import precision as precision_lib
from jtrain import state as state_lib
from jtrain import step as step_lib
from jtrain.control import decide as decide_lib
from jtrain.engine import checks as model_checks
from jtrain.engine import evaluation as evaluator
from jtrain.engine import lm_tasks
from jtrain.engine import own_step
from jtrain.engine import parts
from jtrain.engine.parts import Build, model_flops_per_example  # noqa: F401
from jtrain.errors import ConfigError
from jtrain.observe.outputs import LOSS_SOURCE_KEY, MODEL_SOURCE_KEY  # noqa: F401


def build(cfg, *, sample, eval_example: dict, model=None, loss_fn: Callable | None = None,
          byte_level: bool = False, eval_defaults: bool = False,
          train_example: dict | None = None, step=None, tx=None) -> Build:
    """Model, mesh, optimizer, abstract state and shardings, jitted steps: the set-up that
    training, `python -m jtrain.evaluate` and the benchmarks share. `sample`: one example's
    inputs (any pytree of arrays), `eval_example`: one eval example (for its targets).
    `eval_defaults`: the task's default metrics on top of `eval.metrics` (the report).
    `train_example`: one training example; with a memory budget (control.memory) the
    step's grad_accum_steps is planned from it. `step`: a step of your own
    (jtrain.step.Step; also taken as `model`, and built from `step.factory` when the
    config names one), set up by jtrain.engine.own_step.build instead. `tx`: an
    optax transformation used as the optimizer instead of optim.* (jtrain.train(tx=...)).

    Examples:
        ```python
        import numpy as np
        import jtrain

        cfg = jtrain.resolve({"total_steps": 10})
        b = jtrain.build(cfg, sample=np.zeros(4, np.float32),
                         eval_example={"inputs": np.zeros(4, np.float32),
                                       "targets": np.int32(0)},
                         model=Net)                  # Net: an nnx.Module class
        state = b.init()                             # the fresh state, in its shardings
        state, metrics = b.train_step(state, jtrain.host_to_device(batch, b.mesh))
        ```
    """
    if isinstance(model, step_lib.Step):
        step, model = model, None
    if step is None and cfg.step.factory:
        step = own_step.load(cfg.step)
    if step is not None:
        return own_step.build(cfg, step, eval_example=eval_example,
                              train_example=train_example, loss_fn=loss_fn)
    mesh, policy = mesh_lib.make_mesh(cfg.mesh), precision_lib.make_policy(cfg.model)
    module, user = parts.model_object(cfg, model, policy, mesh)
    lora_fns, extra_trainable, lora_record = parts.lora(cfg, module, sample, mesh)
    m = parts.model_functions(cfg, module, user, policy, sample, mesh, lora_fns)
    loss = parts.loss_of(cfg, loss_fn)
    tx_given = tx is not None
    tx, schedule = parts.optimizer(cfg, tx, extra_trainable)
    abstract, shardings, init, policy = parts.member_state(cfg, m, tx, policy, mesh)
    trainable = parts.trainable(cfg, abstract.params, extra_trainable)
    pop, state_abstract, state_shardings, init = parts.population(
        cfg, mesh, m, tx, policy, abstract, shardings, init)
    metrics_spec = parts.train_metrics(cfg, m, abstract.params,
                                       train_example or eval_example, loss)

    def step_of(accum):
        return parts.train_step_of(cfg, mesh, m, loss, tx, schedule, policy, state_shardings,
                                   pop, metrics_spec, accum)

    plan, accum, plan_record = parts.memory_plan(cfg, mesh, train_example, state_abstract,
                                                 step_of)
    train_step = step_of(accum)
    eval_spec = evaluator.make_spec(cfg.eval, m.fns.apply, abstract.params, m.inputs,
                                    eval_example, byte_level=byte_level,
                                    with_defaults=eval_defaults, predict_fn=loss.predict_fn,
                                    model_inputs=loss.model_inputs)
    eval_step, eval_tail = parts.eval_steps(cfg, mesh, m.fns.apply, loss, eval_spec,
                                            state_lib.eval_part(shardings))
    decided = {**lora_record, **parts.auto_shard_record(cfg, mesh, abstract, shardings),
               **plan_record}
    return Build(
        mesh=mesh, policy=policy, model_fns=m.fns, model_name=m.name, sample_inputs=m.inputs,
        loss_fn=loss.fn, tx=tx, schedule=schedule, abstract=abstract, shardings=shardings,
        state_abstract=state_abstract, state_shardings=state_shardings, init=init,
        train_step=train_step, eval_step=eval_step, eval_tail=eval_tail, eval_spec=eval_spec,
        grad_accum_steps=accum, trainable=trainable, memory_plan=plan, population=pop,
        flops_per_example=m.flops, tx_given=tx_given, decided=decided)


def check_run(cfg, b: Build, data) -> None:
    """Config values, data and models that would make the run wrong, found before the
    first step (`data`: a jtrain.data.RunData): the model and loss called on example 0,
    a default loss without targets, monitors of metrics the eval lacks, targets that do
    not fit the model's output."""
    if b.user_step is not None:
        return own_step.check(cfg, b, data)
    named = {"train_data": data.train_example,
             **({"eval_data": data.example} if data.eval is not None else {})}
    model_inputs = tuple(cfg.data.model_inputs)
    model_checks.check_model_and_loss(b.model_fns.apply, b.loss_fn, b.abstract.params, named,
                                   model_inputs=model_inputs,
                                   model=b.model_name.removeprefix("user "))
    if b.loss_fn is None and "targets" not in data.example:
        raise data_lib.DataError(
            f"{'eval_data' if data.eval is not None else 'train_data'}[0]: no 'targets' "
            f"field (fields: {', '.join(sorted(map(str, data.example)))}); the default "
            "loss needs one: pass loss_fn(outputs, batch), or set loss.fn or loss.terms")
    terms = model_checks.loss_term_names(b.model_fns.apply, b.loss_fn, b.abstract.params,
                                      data.example, model_inputs)
    keys = None if data.eval is None else evaluator.metric_keys(b.eval_spec, terms,
                                                                weights=cfg.eval.weights)
    if cfg.eval.lm_tasks:  # their names come from the config alone
        keys = (keys or set()) | lm_tasks.metric_names(cfg, [
            evaluator.PREFIXES[w] for w in evaluator.weight_sets(cfg.eval.weights)])
    decide_lib.check_monitors(cfg, keys)
    model_checks.check_targets(
        b.eval_spec, model_checks.output_shape_of(b.model_fns.apply, b.abstract.params,
                                               b.sample_inputs),
        {"train_data": data.train, **({"eval_data": data.eval} if data.eval is not None
                                      else {})},
        default_loss=b.loss_fn is None)


def model_sample(cfg, example: dict):
    """One example's model inputs (`step.inputs_of`); a missing data.model_inputs field
    is a ConfigError naming it."""
    missing = [k for k in cfg.data.model_inputs if k not in example]
    if missing:
        raise ConfigError("data.model_inputs", f"no field {missing[0]!r} in the data's items "
                                               f"(fields: {', '.join(sorted(map(str, example)))})")
    return step_lib.inputs_of(example, tuple(cfg.data.model_inputs))
