"""What `build()` (jtrain.engine.assemble) composes: `Build`, the set-up; `Setup`, a Build
in the making; the parts, each `part(cfg, setup) -> setup`, applied in the order of
`PARTS`. Core parts always contribute; a feature's part returns the set-up unchanged when
the config leaves the feature off:

    lora           finetune.lora: adapters on the model's weights; only they train
    ema            optim.ema: the state keeps a weight EMA and the step moves it
    auto_shard     mesh.auto_shard: with fsdp > 1, run.json records where leaves went
    population     population.size > 1: a member axis on the state, the step vmapped,
                   each member evaluated, summary.json's population block
    train_metrics  log.train_metrics: metric states from the train step's own outputs
    memory_plan    a memory budget: the grad_accum_steps whose step fits it
    eval_tail      a batch-level loss: a partial eval batch scored at its true size

A part sets fields: options for the core parts after it (`state_options`, `step_options`,
`step_wraps`), results, how the loop scores the state and what the summary adds
(`per_member`, `reports`), run.json's `decided`. The train step is the built-in update
(`step.make_train_step`) with those options, wrapped and jitted in `train_step_of`, where
a step of your own would take its place. A new feature adds a part, not a branch in
build, the loop or the summary.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Callable

import jax
import numpy as np

from jtrain import checkpoint, invariant, losses
from jtrain import data as data_lib
from jtrain import mesh as mesh_lib
from jtrain import models as models_lib
from jtrain import optim as optim_lib
from jtrain import precision as precision_lib
from jtrain import state as state_lib
from jtrain import step as step_lib
from jtrain.control import memory as memory_lib
from jtrain.engine import checks as model_checks
from jtrain.engine import evaluation as evaluator
from jtrain.engine import population as population_lib
from jtrain.errors import ConfigError, JtrainError
from jtrain.losses import terms as loss_terms
from jtrain.models import adapters
from jtrain.models import lora as lora_lib


def _one_member(state, evaluate):
    return evaluate(state)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Build:
    """What `build` sets up: everything a run, an evaluation or a benchmark needs before
    the first array exists. `init()` builds the fresh state directly in its shardings.

    Attributes:
        mesh: the device mesh (`jtrain.make_mesh`).
        policy: the dtype policy (`jtrain.make_policy`).
        model_fns: the model as pure functions (`jtrain.to_model_fns`).
        model_name: the built-in family, or "user <Class>".
        sample_inputs: ShapeDtypeStructs of one global batch of inputs.
        loss_fn: the user's or the config's loss; None for the default loss.
        tx: the optax optimizer.
        schedule: its learning-rate schedule.
        abstract: one member's state as ShapeDtypeStructs.
        shardings: its NamedShardings.
        state_abstract: the whole state (a population: the member axis in front).
        state_shardings: the whole state's NamedShardings.
        init: `init() -> TrainState`, the fresh state built in its shardings.
        train_step: `jit(state, batch) -> (state, metrics)`, the state donated.
        eval_step: `jit(params, batch) -> (metric states, rows, loss terms)`.
        eval_tail: the eval step on replicated rows (a loss over the whole batch).
        eval_spec: the metrics an evaluation computes (`jtrain.metrics.EvalSpec`).
        grad_accum_steps: microbatches per update (the memory plan's, if any).
        trainable: `{"train" | "frozen": (leaves, count)}` of the parameters.
        memory_plan: the plan when `control.memory` gave a budget, else None.
        population: the population when `population.size` > 1, else None.
        flops_per_example: training FLOPs of one example, when known.
        per_member: `(state, evaluate) -> Evaluation` of what the state holds.
        reports: what the parts add to summary.json, `(cfg, run, state, session,
            final_eval) -> dict` each.
        decided: the values the set-up decided (run.json's "decided").
        user_step: a step of your own (`jtrain.step.Step`), None for the built-in.
        tx_given: True when `tx` is the one given to `jtrain.train(tx=...)`.

    Examples:
        ```python
        b = jtrain.build(cfg, sample=example_inputs, eval_example=example, model=Net)
        print(b.model_name, b.grad_accum_steps, b.mesh.shape)
        state = b.init()
        ```
    """
    mesh: Any = None
    policy: precision_lib.Policy | None = None
    model_fns: adapters.ModelFns | None = None
    model_name: str = ""  # the built-in family, or "user <Class>"
    sample_inputs: Any = None  # ShapeDtypeStructs of one global batch of inputs
    loss_fn: Callable | None = None  # the user's / the config's loss; None = default
    tx: Any = None
    schedule: Callable | None = None
    # One member's state (a population's member; else the state): ShapeDtypeStructs and
    # NamedShardings, the same tree.
    abstract: state_lib.TrainState | None = None
    shardings: Any = None
    # The whole state, what `init`, `train_step` and a restore use (a population: the
    # member axis in front of every leaf but `step`).
    state_abstract: state_lib.TrainState | None = None
    state_shardings: Any = None
    init: Callable[[], state_lib.TrainState] | None = None  # the fresh state, sharded
    train_step: Callable | None = None  # jit(state, batch) -> (state, metrics), donated
    eval_step: Callable | None = None  # jit(params, batch) -> (metric states, rows, terms)
    eval_tail: Callable | None = None  # eval_step on replicated rows (a batch-level loss)
    eval_spec: Any = None  # jtrain.metrics.EvalSpec
    grad_accum_steps: int = 1  # what the train step uses (the memory plan's, if any)
    trainable: dict | None = None  # optim.trainable_split: {"train"|"frozen": (leaves, n)}
    memory_plan: Any = None  # control.memory.Plan when a budget was given, else None
    population: Any = None  # engine.population.Population when population.size > 1
    flops_per_example: float | None = None  # training FLOPs of one example, if known
    # per_member(state, evaluate): one Evaluation of what the state holds (a population:
    # each member's, combined); reports: (cfg, run, state, session, final_eval) -> dict.
    per_member: Callable = _one_member
    reports: tuple[Callable, ...] = ()
    decided: dict = dataclasses.field(default_factory=dict)  # run.json's "decided"
    user_step: Any = None  # a step of your own (jtrain.step.Step), else None: built-in
    tx_given: bool = False  # the optimizer is train(tx=...)'s, not optim.*'s

    def abstract_with_shardings(self):
        """What orbax restores into."""
        return checkpoint.abstract_with_shardings(self.state_abstract, self.state_shardings)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setup(Build):
    """A Build in the making, and what parts hand to the parts after them."""
    user_model: Any = None  # the model object given (or model.factory's); None: built-in
    module: Any = None  # the model object the model functions come from
    sample: Any = None  # one example's model inputs
    eval_example: dict | None = None  # one eval example (its targets)
    train_example: dict | None = None  # one training example (the memory plan)
    byte_level: bool = False  # byte-level text (bits per byte)
    eval_defaults: bool = False  # the task's default metrics too (jtrain evaluate)
    extra_trainable: tuple[str, ...] = ()  # patterns added to optim.trainable (LoRA's)
    user_tx: Any = None  # train(tx=...): an optax transformation, else None: optim.*
    model_inputs: tuple = ()  # data.model_inputs
    valid_fn: Callable | None = None  # data.valid_fn
    predict_fn: Callable | None = None  # eval.predict_fn
    batch_loss: bool = False  # the loss scores whole batches (loss.eval_scope)
    state_options: dict = dataclasses.field(default_factory=dict)  # make_abstract_state's
    step_options: dict = dataclasses.field(default_factory=dict)  # make_train_step's
    step_wraps: tuple[Callable, ...] = ()  # train step -> train step, in order
    eval_fn: Callable | None = None  # the eval step before jit

    def replace(self, **changes) -> "Setup":
        return dataclasses.replace(self, **changes)


def mesh_and_policy(cfg, s: Setup) -> Setup:
    """The device mesh (mesh.make_mesh) and the dtype policy (precision.make_policy)."""
    return s.replace(mesh=mesh_lib.make_mesh(cfg.mesh),
                     policy=precision_lib.make_policy(cfg.model))


def model(cfg, s: Setup) -> Setup:
    """The model object: yours (its layers computing in the policy's dtype), model.factory's
    (treated as yours), or the built-in family of model.name."""
    policy, module = s.policy, s.user_model
    if module is None:
        module = models_lib.make_model(cfg.model, dtype=policy.compute_dtype,
                                       param_dtype=policy.param_dtype)
    user = module if s.user_model is not None or cfg.model.name == "user" else None
    if user is not None and policy.compute_dtype != np.float32:
        module = adapters.with_compute_dtype(module, policy.compute_dtype,
                                             tuple(cfg.model.keep_fp32))
    return s.replace(user_model=user, module=module)


def lora(cfg, s: Setup) -> Setup:
    """finetune.lora: adapters on the targeted weights (models.lora), whose patterns join
    optim.trainable, so only they train; run.json records the addition."""
    if not cfg.finetune.lora.rank:
        return s
    fns, extra = lora_lib.to_model_fns(s.module, cfg, s.sample, s.mesh)
    return s.replace(model_fns=fns, extra_trainable=extra, decided={
        **s.decided, "optim.trainable": {"value": [*cfg.optim.trainable, *extra],
                                         "from": "finetune.lora",
                                         "configured": list(cfg.optim.trainable)}})


def model_fns(cfg, s: Setup) -> Setup:
    """The model's init / apply (models.adapters: Linen, NNX or pure), unless a part made
    them; yours computes in the policy's dtype (precision.cast_apply). Its name, one
    global batch of its inputs, its training FLOPs per example."""
    fns = s.model_fns if s.model_fns is not None else adapters.to_model_fns(s.module, s.mesh)
    user = s.user_model
    name = cfg.model.name if user is None else f"user {_model_name(user, fns)}"
    if user is not None:
        fns = dataclasses.replace(fns, apply=precision_lib.cast_apply(
            fns.apply, s.policy, tuple(cfg.model.keep_fp32)))
    inputs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        (cfg.data.batch_size,) + np.shape(x), np.asarray(x).dtype), s.sample)
    return s.replace(model_fns=fns, model_name=name, sample_inputs=inputs,
                     flops_per_example=model_flops_per_example(
                         user, cfg.model, jax.tree.map(np.shape, s.sample)))


def loss(cfg, s: Setup) -> Setup:
    """The loss (train()'s loss_fn, else loss.fn / loss.terms, else None: the default) and
    whether it scores whole batches (loss.eval_scope); the data's model inputs, row
    validity (data.valid_fn) and eval.predict_fn."""
    fn, multi = s.loss_fn, False
    if fn is None:
        fn, multi = loss_terms.from_config(cfg.loss)
    scope = cfg.loss.eval_scope
    return s.replace(
        loss_fn=fn, batch_loss=scope == "batch" or (scope == "auto" and multi),
        model_inputs=tuple(cfg.data.model_inputs),
        valid_fn=data_lib.load_named(cfg.data.valid_fn, "data.valid_fn")
        if cfg.data.valid_fn else None,
        predict_fn=data_lib.load_named(cfg.eval.predict_fn, "eval.predict_fn")
        if cfg.eval.predict_fn else None)


def optimizer(cfg, s: Setup) -> Setup:
    """The optax chain and its schedule (optim.make_optimizer), with the trainable
    patterns parts added; a population that varies optim.weight_decay keeps each
    member's rate in the optimizer state. A transformation given to train(tx=...) is
    the optimizer instead (optim.given_optimizer)."""
    if s.user_tx is not None:
        if cfg.population.size > 1:
            raise ConfigError("population.size", "a population builds one optimizer per "
                              "member from optim.*; with jtrain.train(tx=...) set "
                              "population.size=1")
        tx, schedule = optim_lib.given_optimizer(s.user_tx, cfg.optim, cfg.total_steps,
                                                 extra_trainable=s.extra_trainable)
        return s.replace(tx=tx, schedule=schedule, tx_given=True,
                         grad_accum_steps=cfg.optim.grad_accum_steps)
    tx, schedule = optim_lib.make_optimizer(
        cfg.optim, cfg.total_steps, extra_trainable=s.extra_trainable,
        decay_in_state=population_lib.decay_in_state(cfg))
    return s.replace(tx=tx, schedule=schedule, grad_accum_steps=cfg.optim.grad_accum_steps)


def ema(cfg, s: Setup) -> Setup:
    """optim.ema: the state keeps a weight EMA (state.py), which the step moves after each
    applied update."""
    if not cfg.optim.ema.decay > 0:
        return s
    return s.replace(state_options={**s.state_options, "ema": True}, step_options={
        **s.step_options, "ema_decay": float(cfg.optim.ema.decay),
        "ema_warmup": str(cfg.optim.ema.warmup)})


def state(cfg, s: Setup) -> Setup:
    """Shapes before arrays: the abstract state and its shardings (state.py; leaves
    without logical axes by mesh.auto_shard's rule), the train-mode state check, the
    policy with what the traced model computes in, the fresh state's init."""
    try:  # Linen's init calls the model: the first time it meets the data's inputs
        abstract, shardings = state_lib.make_abstract_state(
            s.model_fns, s.tx, s.policy, s.sample_inputs, s.mesh, cfg.seed,
            auto_shard_min_bytes=mesh_lib.auto_shard_bytes(cfg.mesh), **s.state_options)
    except JtrainError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's model: one line, no traceback
        raise model_checks.model_call_error(
            e, s.sample_inputs, model=s.model_name.removeprefix("user ")) from e
    policy = _measure_precision(s.policy, cfg, s.model_fns, abstract.params,
                                s.sample_inputs, s.mesh)
    return s.replace(abstract=abstract, shardings=shardings, state_abstract=abstract,
                     state_shardings=shardings, policy=policy, init=functools.partial(
                         state_lib.init_state, s.model_fns, s.tx, policy, s.sample_inputs,
                         s.mesh, cfg.seed, shardings))


def trainable(cfg, s: Setup) -> Setup:
    """Which parameters train (optim.trainable / frozen / lr_mults and the patterns parts
    added): a pattern that matches no parameter is a ConfigError before the first step."""
    if not (cfg.optim.trainable or cfg.optim.frozen or cfg.optim.lr_mults
            or s.extra_trainable):
        return s
    return s.replace(trainable=optim_lib.trainable_split(s.abstract.params, cfg.optim,
                                                         s.extra_trainable))


def auto_shard(cfg, s: Setup) -> Setup:
    """mesh.auto_shard (applied by `state`): with fsdp > 1, run.json records where the
    parameters and the optimizer state were laid out."""
    if not s.mesh.shape["fsdp"] > 1:
        return s
    min_bytes = mesh_lib.auto_shard_bytes(cfg.mesh)
    return s.replace(decided={**s.decided, "mesh.auto_shard": {
        "value": min_bytes is not None, "from": "mesh.fsdp > 1",
        "params": mesh_lib.layout(s.abstract.params, s.shardings.params, min_bytes),
        "opt_state": mesh_lib.layout(s.abstract.opt_state, s.shardings.opt_state)}})


def population(cfg, s: Setup) -> Setup:
    """population.size > 1 (engine.population): the member axis in front of the state
    (sharded over the data axis when it can be), every member's init, the step vmapped,
    each member evaluated, summary.json's population block and population.png."""
    pop = population_lib.from_config(cfg)
    if pop is None:
        return s
    pop = population_lib.with_mesh(pop, s.mesh, s.shardings)
    shardings = population_lib.shardings(pop, s.shardings)
    return s.replace(
        population=pop, state_abstract=population_lib.abstract(pop, s.abstract),
        state_shardings=shardings,
        init=functools.partial(population_lib.init, pop, s.model_fns, s.tx, s.policy,
                               s.sample_inputs, s.mesh, shardings,
                               ema=s.shardings.ema is not None),
        step_wraps=(*s.step_wraps, functools.partial(population_lib.train_step, pop)),
        per_member=functools.partial(population_lib.per_member, pop),
        reports=(*s.reports, functools.partial(population_lib.report, pop)))


def train_metrics(cfg, s: Setup) -> Setup:
    """log.train_metrics: the eval metrics' definitions on the train step's outputs, their
    states merged exactly over microbatches (train/<name> at log steps); a metric the
    outputs cannot give is a ConfigError naming the key."""
    if not cfg.log.train_metrics:
        return s
    names = types.SimpleNamespace(metrics=tuple(cfg.log.train_metrics), top_k=cfg.eval.top_k,
                                  max_gathered=cfg.eval.max_gathered)
    try:
        spec = evaluator.make_spec(names, s.model_fns.apply, s.abstract.params,
                                   s.sample_inputs, s.train_example or s.eval_example,
                                   predict_fn=s.predict_fn, model_inputs=s.model_inputs)
    except ConfigError as e:
        raise ConfigError("log.train_metrics", e.why) from None
    return s.replace(step_options={**s.step_options, "train_metrics": spec,
                                   "predict_fn": s.predict_fn})


def memory_plan(cfg, s: Setup) -> Setup:
    """A memory budget (memory.budget_bytes, or what the device reports) and a training
    example: the smallest grad_accum_steps whose compiled step fits (control.memory);
    run.json records it."""
    budget, source = memory_lib.device_budget(cfg.memory.budget_bytes, s.mesh.devices.flat[0])
    if budget is None or s.train_example is None:
        return s
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        (cfg.data.batch_size,) + np.shape(x), np.asarray(x).dtype), s.train_example)

    def measure(accum):
        compiled = train_step_of(cfg, s, grad_accum_steps=accum).lower(s.state_abstract, batch)
        return memory_lib.step_bytes(compiled.compile())

    plan = memory_lib.plan(measure, per_device_batch=cfg.data.batch_size
                           // mesh_lib.data_parallel_size(s.mesh),
                           configured=cfg.optim.grad_accum_steps, budget=budget,
                           source=source)
    return s.replace(memory_plan=plan, grad_accum_steps=plan.accum, decided={
        **s.decided, "optim.grad_accum_steps": {"value": plan.accum, "from": "memory plan",
                                                "configured": cfg.optim.grad_accum_steps}})


def train_step(cfg, s: Setup) -> Setup:
    """The train step, jitted once (`train_step_of`)."""
    return s.replace(train_step=train_step_of(cfg, s))


def eval_step(cfg, s: Setup) -> Setup:
    """What the evaluation computes (eval.metrics, the task's defaults: engine.evaluation)
    and its step on one member's params, jitted with the batch sharded."""
    spec = evaluator.make_spec(cfg.eval, s.model_fns.apply, s.abstract.params,
                               s.sample_inputs, s.eval_example, byte_level=s.byte_level,
                               with_defaults=s.eval_defaults, predict_fn=s.predict_fn,
                               model_inputs=s.model_inputs)
    fn = step_lib.make_eval_step(
        s.model_fns.apply, s.loss_fn or losses.default_loss, user_loss=s.loss_fn is not None,
        metrics=spec, model_inputs=s.model_inputs, predict_fn=s.predict_fn,
        batch_loss=s.batch_loss)
    return s.replace(eval_spec=spec, eval_fn=fn,
                     eval_step=eval_of(cfg, s, fn, state_lib.eval_part(s.shardings)))


def eval_of(cfg, s: Setup, fn: Callable, params_shardings) -> Callable:
    """The eval step: jitted with the batch sharded, or determinism.topology_invariant's
    chunked form (`invariant.SplitEval`: programs for one device on each device)."""
    chosen = invariant_of(cfg, s)
    if chosen is not None:
        return invariant.SplitEval(fn, *chosen)
    batch_sharding, repl = mesh_lib.batch_sharding(s.mesh), mesh_lib.replicated(s.mesh)
    return jax.jit(fn, in_shardings=(params_shardings, batch_sharding),
                   out_shardings=(repl, batch_sharding, repl))


def eval_tail(cfg, s: Setup) -> Setup:
    """A batch-level loss of yours (loss.eval_scope): the eval step on replicated rows, so
    a partial last batch is scored at its true size (engine.evaluation)."""
    if not (s.batch_loss and s.loss_fn is not None):
        return s
    repl = mesh_lib.replicated(s.mesh)
    return s.replace(eval_tail=jax.jit(s.eval_fn, in_shardings=(
        state_lib.eval_part(s.shardings), repl),
                                       out_shardings=repl))


PARTS: tuple[Callable[[Any, Setup], Setup], ...] = (
    mesh_and_policy, model, lora, model_fns, optimizer, ema, state, trainable, loss,
    auto_shard, population, train_metrics, memory_plan, train_step, eval_step, eval_tail)


def train_step_of(cfg, s: Setup, **options):
    """The built-in update (step.make_train_step) with the options parts added (and
    `options` over them: the memory plan's trials), each wrap applied (a population's
    vmap), jitted with the whole state's shardings and the state donated. A step of
    your own would take the built-in update's place here."""
    step = step_lib.make_train_step(
        s.model_fns.apply, s.loss_fn or losses.default_loss, s.tx, s.schedule,
        dynamic_loss_scale=s.policy.dynamic_loss_scale,
        halt_on_nonfinite=cfg.nonfinite.policy == "halt",
        max_consecutive=cfg.nonfinite.max_consecutive, valid_fn=s.valid_fn,
        model_inputs=s.model_inputs, invariant=invariant_of(cfg, s, s.state_shardings),
        **{"grad_accum_steps": s.grad_accum_steps, **s.step_options, **options})
    if isinstance(step, invariant.SplitStep):  # several programs: nothing to jit or donate
        return step
    for wrap in s.step_wraps:
        step = wrap(step)
    return jax.jit(step, in_shardings=(s.state_shardings, mesh_lib.batch_sharding(s.mesh)),
                   out_shardings=(s.state_shardings, mesh_lib.replicated(s.mesh)),
                   donate_argnums=0)


def invariant_of(cfg, s: Setup, *extra):
    """(mesh, chunks, *extra) for determinism.topology_invariant, None when off; a
    ConfigError for what the mode does not cover."""
    det = cfg.determinism
    if not det.topology_invariant:
        return None
    if s.mesh.shape["tensor"] > 1:
        raise ConfigError("determinism.topology_invariant", "not implemented with tensor "
                          f"parallelism (mesh.tensor={s.mesh.shape['tensor']}); use the data "
                          "and fsdp axes")
    if cfg.population.size > 1:
        raise ConfigError("determinism.topology_invariant", "not implemented for a "
                          "population (population.size > 1)")
    rows = cfg.data.batch_size
    n = mesh_lib.data_parallel_size(s.mesh)
    if rows % det.chunks:
        raise ConfigError("determinism.chunks", f"{det.chunks} does not divide "
                          f"data.batch_size={rows}")
    if cfg.eval.batch_size % det.chunks:  # 0: data.batch_size's, checked above
        raise ConfigError("determinism.chunks", f"{det.chunks} does not divide "
                          f"eval.batch_size={cfg.eval.batch_size}")
    if det.chunks % n:
        raise ConfigError("determinism.chunks", f"{det.chunks} is not a multiple of the "
                          f"{n} devices of the data and fsdp axes")
    accum = cfg.optim.grad_accum_steps
    if (rows // det.chunks) % accum:  # each chunk is cut into the microbatches
        raise ConfigError("determinism.chunks", f"a chunk of {rows // det.chunks} rows "
                          f"(data.batch_size={rows} / {det.chunks}) is not divisible by "
                          f"optim.grad_accum_steps={accum}")
    return (s.mesh, det.chunks, *extra)


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
