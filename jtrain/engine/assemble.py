"""`build()`: the set-up that training, `python -m jtrain.evaluate` and the benchmarks
share — model (built-in, `model.factory` or yours, LoRA-wrapped when configured), mesh,
optimizer, loss (yours, `loss.fn` or `loss.terms`), abstract state, shardings and the
jitted steps — before the first array exists.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable

import jax
import numpy as np

from jtrain import checkpoint, losses
from jtrain import data as data_lib
from jtrain import mesh as mesh_lib
from jtrain import models as models_lib
from jtrain import optim as optim_lib
from jtrain import precision as precision_lib
from jtrain import state as state_lib
from jtrain import step as step_lib
from jtrain.control import decide as decide_lib
from jtrain.control import memory as memory_lib
from jtrain.engine import checks as model_checks
from jtrain.engine import evaluation as evaluator
from jtrain.engine import population as population_lib
from jtrain.errors import ConfigError, JtrainError
from jtrain.losses import terms as loss_terms
from jtrain.models import adapters
from jtrain.models import lora as lora_lib
from jtrain.observe.outputs import LOSS_SOURCE_KEY, MODEL_SOURCE_KEY  # noqa: F401


@dataclasses.dataclass(frozen=True)
class Build:
    """What `build` sets up: everything a run, an evaluation or a benchmark needs before
    the first array exists. `init()` builds the fresh state directly in its shardings."""
    mesh: Any
    policy: precision_lib.Policy
    model_fns: adapters.ModelFns
    model_name: str  # the built-in family, or "user <Class>"
    user_model: Any  # the model object given to train(), None for a built-in
    tx: Any
    schedule: Callable
    sample_inputs: Any  # ShapeDtypeStructs of one global batch of inputs
    abstract: state_lib.TrainState  # ShapeDtypeStructs
    shardings: Any  # NamedShardings, same tree
    eval_spec: Any  # jtrain.metrics.EvalSpec
    train_step: Callable  # jit(state, batch) -> (state, metrics), state donated
    eval_step: Callable  # jit(params, batch) -> (metric states, batch rows)
    seed: int
    eval_tail: Callable | None = None  # loss.eval_scope=batch: eval_step on replicated rows
    memory_plan: Any = None  # control.memory.Plan when a budget was given, else None
    trainable: dict | None = None  # optim.trainable_split: {"train"|"frozen": (leaves, n)}
    loss_fn: Callable | None = None  # the user's / the config's loss; None = default
    grad_accum_steps: int = 1  # what the train step uses (the memory plan's, if any)
    extra_trainable: tuple[str, ...] = ()  # added to optim.trainable (LoRA's adapters)
    flops_per_example: float | None = None  # training FLOPs of one example, if known
    ema_decay: float = 0.0  # optim.ema.decay: the state keeps a weight EMA when > 0
    # population.size > 1: the state has a leading member axis (jtrain.engine.population);
    # `abstract` / `shardings` stay one member's, `init` and `abstract_with_shardings`
    # are the population's, `train_step` steps every member, `eval_step` takes one's.
    population: Any = None

    def decided(self, cfg) -> dict:
        """What the set-up decided beyond the config, as run.json records it:
        {"optim.grad_accum_steps": {"value": 2, "from": "memory plan"}, ...}."""
        out = {}
        if self.memory_plan is not None:
            out["optim.grad_accum_steps"] = {"value": self.grad_accum_steps,
                                             "from": "memory plan",
                                             "configured": cfg.optim.grad_accum_steps}
        if self.mesh.shape["fsdp"] > 1:  # where parameters are laid out (mesh.auto_shard)
            min_bytes = mesh_lib.auto_shard_bytes(cfg.mesh)
            out["mesh.auto_shard"] = {
                "value": min_bytes is not None, "from": "mesh.fsdp > 1",
                "params": mesh_lib.layout(self.abstract.params, self.shardings.params,
                                          min_bytes),
                "opt_state": mesh_lib.layout(self.abstract.opt_state,
                                             self.shardings.opt_state)}
        if self.extra_trainable:
            out["optim.trainable"] = {
                "value": [*cfg.optim.trainable, *self.extra_trainable],
                "from": "finetune.lora", "configured": list(cfg.optim.trainable)}
        return out

    def init(self) -> state_lib.TrainState:
        if self.population is not None:
            return population_lib.init(self.population, self.model_fns, self.tx, self.policy,
                                       self.sample_inputs, self.mesh, self.state_shardings,
                                       ema=self.ema_decay > 0)
        return state_lib.init_state(self.model_fns, self.tx, self.policy, self.sample_inputs,
                                    self.mesh, self.seed, self.shardings)

    @property
    def state_abstract(self):
        """The whole state's abstract tree (the population's when there is one)."""
        if self.population is None:
            return self.abstract
        return population_lib.abstract(self.population, self.abstract)

    @property
    def state_shardings(self):
        """The whole state's shardings (the population's when there is one)."""
        if self.population is None:
            return self.shardings
        return population_lib.shardings(self.population, self.shardings)

    def abstract_with_shardings(self):
        """What orbax restores into."""
        return checkpoint.abstract_with_shardings(self.state_abstract, self.state_shardings)


def build(cfg, *, sample, eval_example: dict, model=None, loss_fn: Callable | None = None,
          byte_level: bool = False, eval_defaults: bool = False,
          train_example: dict | None = None) -> Build:
    """Model, mesh, optimizer, abstract state and shardings, jitted steps: the set-up that
    training, `python -m jtrain.evaluate` and the benchmarks share. `sample`: one example's
    inputs (any pytree of arrays), `eval_example`: one eval example (for its targets).
    `eval_defaults`: the task's default metrics on top of `eval.metrics` (the report).
    `train_example`: one training example; with a memory budget (control.memory) the
    step's grad_accum_steps is planned from it."""
    mesh = mesh_lib.make_mesh(cfg.mesh)
    policy = precision_lib.make_policy(cfg.model)
    if model is None and cfg.model.name == "user":  # model.factory: treated as passed in
        model = models_lib.make_model(cfg.model, dtype=policy.compute_dtype,
                                      param_dtype=policy.param_dtype)
    module = model if model is not None else models_lib.make_model(
        cfg.model, dtype=policy.compute_dtype, param_dtype=policy.param_dtype)
    if model is not None and policy.compute_dtype != np.float32:  # its layers' dtype too
        module = adapters.with_compute_dtype(module, policy.compute_dtype,
                                             tuple(cfg.model.keep_fp32))
    # finetune.lora: adapters on the model, and the patterns that make only them train.
    model_fns, extra_trainable = lora_lib.to_model_fns(module, cfg, sample, mesh)
    name = cfg.model.name if model is None else f"user {_model_name(model, model_fns)}"
    if model is not None:  # your model computes in the policy's dtype (precision.py)
        model_fns = dataclasses.replace(model_fns, apply=precision_lib.cast_apply(
            model_fns.apply, policy, tuple(cfg.model.keep_fp32)))
    tx, schedule = optim_lib.make_optimizer(
        cfg.optim, cfg.total_steps, extra_trainable=extra_trainable,
        decay_in_state=population_lib.decay_in_state(cfg))
    ema_decay, ema_warmup = float(cfg.optim.ema.decay), str(cfg.optim.ema.warmup)
    sample_inputs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        (cfg.data.batch_size,) + np.shape(x), np.asarray(x).dtype), sample)
    try:  # Linen's init calls the model: the first time it meets the data's inputs
        abstract, shardings = state_lib.make_abstract_state(
            model_fns, tx, policy, sample_inputs, mesh, cfg.seed, ema=ema_decay > 0,
            auto_shard_min_bytes=mesh_lib.auto_shard_bytes(cfg.mesh))
    except JtrainError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's model: one line, no traceback
        raise model_checks.model_call_error(e, sample_inputs, model=name.removeprefix("user ")) \
            from e
    with mesh_lib.model_context(mesh):  # state a train-mode forward changes: refused
        adapters.check_state_carried(model_fns, abstract.params, sample_inputs)
    policy = _measure_precision(policy, cfg, model_fns, abstract.params, sample_inputs, mesh)
    split = None
    if cfg.optim.trainable or cfg.optim.frozen or cfg.optim.lr_mults or extra_trainable:
        # regexes that match no parameter are typos: a ConfigError before the first step
        split = optim_lib.trainable_split(abstract.params, cfg.optim, extra_trainable)

    batch_sharding, repl = mesh_lib.batch_sharding(mesh), mesh_lib.replicated(mesh)
    valid_fn = data_lib.load_named(cfg.data.valid_fn, "data.valid_fn") \
        if cfg.data.valid_fn else None
    predict_fn = data_lib.load_named(cfg.eval.predict_fn, "eval.predict_fn") \
        if cfg.eval.predict_fn else None
    multi = False
    if loss_fn is None:  # loss.fn / loss.terms (a loss_fn passed to train() wins)
        loss_fn, multi = loss_terms.from_config(cfg.loss)
    batch_loss = cfg.loss.eval_scope == "batch" or (cfg.loss.eval_scope == "auto" and multi)
    model_inputs = tuple(cfg.data.model_inputs)
    population = population_lib.from_config(cfg)
    state_abstract, state_shardings = abstract, shardings
    if population is not None:  # the member axis in front of every leaf
        population = population_lib.with_mesh(population, mesh, shardings)
        state_abstract = population_lib.abstract(population, abstract)
        state_shardings = population_lib.shardings(population, shardings)
    train_spec = _train_metrics_spec(cfg, model_fns.apply, abstract.params, sample_inputs,
                                     train_example or eval_example, predict_fn, model_inputs)

    def make_train_step(accum):
        step = step_lib.make_train_step(
            model_fns.apply, loss_fn or losses.default_loss, tx, schedule,
            grad_accum_steps=accum, dynamic_loss_scale=policy.dynamic_loss_scale,
            halt_on_nonfinite=cfg.nonfinite.policy == "halt",
            max_consecutive=cfg.nonfinite.max_consecutive, valid_fn=valid_fn,
            model_inputs=model_inputs, ema_decay=ema_decay, ema_warmup=ema_warmup,
            train_metrics=train_spec, predict_fn=predict_fn)
        if population is not None:
            step = population_lib.train_step(population, step)
        return jax.jit(step, in_shardings=(state_shardings, batch_sharding),
                       out_shardings=(state_shardings, repl), donate_argnums=0)

    memory_plan = _plan_memory(cfg, mesh, make_train_step, state_abstract, train_example)
    accum = memory_plan.accum if memory_plan else cfg.optim.grad_accum_steps
    train_step = make_train_step(accum)
    eval_spec = evaluator.make_spec(cfg.eval, model_fns.apply, abstract.params, sample_inputs,
                                    eval_example, byte_level=byte_level,
                                    with_defaults=eval_defaults, predict_fn=predict_fn,
                                    model_inputs=model_inputs)
    raw_eval_step = step_lib.make_eval_step(
        model_fns.apply, loss_fn or losses.default_loss, user_loss=loss_fn is not None,
        metrics=eval_spec, model_inputs=model_inputs, predict_fn=predict_fn,
        batch_loss=batch_loss)
    eval_step = jax.jit(raw_eval_step, in_shardings=(shardings.params, batch_sharding),
                        out_shardings=(repl, batch_sharding, repl))
    # A batch-level loss scores a partial batch at its true size (jtrain.engine.evaluation).
    eval_tail = (jax.jit(raw_eval_step, in_shardings=(shardings.params, repl),
                         out_shardings=repl) if batch_loss and loss_fn is not None else None)
    return Build(mesh=mesh, policy=policy, model_fns=model_fns, model_name=name,
                 user_model=model, tx=tx, schedule=schedule, sample_inputs=sample_inputs,
                 abstract=abstract, shardings=shardings, eval_spec=eval_spec,
                 train_step=train_step, eval_step=eval_step, eval_tail=eval_tail,
                 seed=cfg.seed,
                 memory_plan=memory_plan, trainable=split, loss_fn=loss_fn,
                 grad_accum_steps=accum, extra_trainable=extra_trainable, ema_decay=ema_decay,
                 population=population,
                 flops_per_example=model_flops_per_example(
                     model, cfg.model, jax.tree.map(np.shape, sample)))


def _train_metrics_spec(cfg, apply_fn, params, sample_inputs, example, predict_fn,
                        model_inputs):
    """log.train_metrics' EvalSpec (the eval definitions on the train step's outputs), or
    None when empty; a metric the outputs cannot give is a ConfigError naming the key."""
    if not cfg.log.train_metrics:
        return None
    names = types.SimpleNamespace(metrics=tuple(cfg.log.train_metrics), top_k=cfg.eval.top_k,
                                  max_gathered=cfg.eval.max_gathered)
    try:
        return evaluator.make_spec(names, apply_fn, params, sample_inputs, example,
                                   predict_fn=predict_fn, model_inputs=model_inputs)
    except ConfigError as e:
        raise ConfigError("log.train_metrics", e.why) from None


def model_flops_per_example(model, model_cfg, input_shape) -> float | None:
    """Training FLOPs per example (observe.perf's MFU): from a user model's
    `flops_per_example` attribute (a number, or a function of one example's input
    shape), or the built-in family's formula when `model` is None; None when unknown."""
    if model is None:
        return models_lib.flops_per_example(model_cfg, input_shape)
    declared = getattr(model, "flops_per_example", None)
    if callable(declared):
        declared = declared(input_shape)
    return float(declared) if declared else None


def check_run(cfg, b: Build, data) -> None:
    """Config values, data and models that would make the run wrong, found before the
    first step (`data`: a jtrain.data.RunData): the model and loss called on example 0,
    a default loss without targets, monitors of metrics the eval lacks, targets that do
    not fit the model's output."""
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
    decide_lib.check_monitors(cfg, None if data.eval is None
                              else evaluator.metric_keys(b.eval_spec, terms,
                                                         weights=cfg.eval.weights))
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


def _measure_precision(policy, cfg, model_fns, params, inputs, mesh):
    """The policy with what the traced forward computes in (precision.matmul_dtypes);
    unchanged when the model cannot be traced here (model_checks reports that)."""
    try:
        with mesh_lib.model_context(mesh):
            matmuls = precision_lib.matmul_dtypes(model_fns.apply, params, inputs)
    except Exception:  # noqa: BLE001 - check_run calls the model and says what is wrong
        return policy
    return precision_lib.measured(policy, matmuls, cfg.model.loss_scale)


def _model_name(model, model_fns) -> str:
    """The class of the user's model, also when a function built it (NNX rngs -> module)."""
    if model_fns.nnx_graph is not None:
        built = getattr(model_fns.nnx_graph.graphdef.nodes[0], "type", None)
        if isinstance(built, type):
            return built.__name__
    if isinstance(model, tuple):
        return "(init, apply)"
    return model.__name__ if isinstance(model, type) else type(model).__name__


def _plan_memory(cfg, mesh, make_train_step, abstract, train_example):
    """control.memory's plan when a budget is known and a train example given, else None."""
    budget, source = memory_lib.device_budget(cfg.memory.budget_bytes,
                                              mesh.devices.flat[0])
    if budget is None or train_example is None:
        return None
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        (cfg.data.batch_size,) + np.shape(x), np.asarray(x).dtype), train_example)

    def measure(accum):
        return memory_lib.step_bytes(make_train_step(accum).lower(abstract, batch).compile())

    return memory_lib.plan(measure, per_device_batch=cfg.data.batch_size
                           // mesh_lib.data_parallel_size(mesh),
                           configured=cfg.optim.grad_accum_steps, budget=budget,
                           source=source)
