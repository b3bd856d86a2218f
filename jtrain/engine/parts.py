"""The helpers `build()` (jtrain.engine.assemble) calls, top-down, each with its inputs
as arguments and its outputs as return values, and `Build`, what it returns. A step of
your own (jtrain.engine.own_step) is a sibling build over the same helpers.

    model_object     the model: yours (computing in the policy's dtype) or the built-in
    lora             finetune.lora: adapters on the model's weights; only they train
    model_functions  init / apply, the model's name, one global batch of inputs, FLOPs
    loss_of          the loss and what it reads (model inputs, row validity, predictions)
    optimizer        the optax chain and its schedule, or train(tx=...)'s
    member_state     one member's abstract state, shardings and init (optim.ema inside)
    population       population.size > 1: the member axis, every member's init
    train_metrics    log.train_metrics: metric states from the train step's outputs
    memory_plan      a memory budget: the grad_accum_steps whose step fits it
    train_step_of    the built-in update, jitted (a population's vmapped)
    eval_steps       the eval step, and a batch-level loss's tail step
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Callable, NamedTuple

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
from jtrain.models import lora as lora_lib, moe as moe_lib, quant as quant_lib


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
    decided: dict = dataclasses.field(default_factory=dict)  # run.json's "decided"
    user_step: Any = None  # a step of your own (jtrain.step.Step), else None: built-in
    tx_given: bool = False  # the optimizer is train(tx=...)'s, not optim.*'s

    def abstract_with_shardings(self):
        """What orbax restores into."""
        return checkpoint.abstract_with_shardings(self.state_abstract, self.state_shardings)



class Loss(NamedTuple):
    """The loss and what it reads: `fn` (None: the default loss), `batch` (it scores whole
    batches: loss.eval_scope), the data's model inputs, row validity (data.valid_fn) and
    eval.predict_fn."""
    fn: Callable | None
    batch: bool
    model_inputs: tuple
    valid_fn: Callable | None
    predict_fn: Callable | None


class Model(NamedTuple):
    """The model as build uses it: its functions, its name ("user <Class>" for yours),
    ShapeDtypeStructs of one global batch of inputs, training FLOPs of one example, and
    the model object the functions come from."""
    fns: adapters.ModelFns
    name: str
    inputs: Any
    flops: float | None
    module: Any = None


def model_object(cfg, given, policy, mesh):
    """(module, user): the model object (yours, its layers computing in the policy's dtype;
    model.factory's, treated as yours; or the built-in family of model.name) and yours
    as given (None for the built-in; refused on a mesh with context > 1, which splits
    the built-in transformer's sequences only)."""
    module = given
    if module is None:
        module = models_lib.make_model(cfg.model, dtype=policy.compute_dtype,
                                       param_dtype=policy.param_dtype)
    user = module if given is not None or cfg.model.name == "user" else None
    context = mesh.shape["context"]
    if user is not None and context > 1:
        raise ConfigError("mesh.context", f"{context} splits the built-in transformer's "
                          f"sequences; a model of your own ({type(user).__name__}) is not "
                          "split: set mesh.context=1")
    if cfg.mesh.stage > 1:
        if user is not None:
            raise ConfigError("mesh.stage", "pipeline stages split the built-in "
                              "transformer's layer stack; a model of your own runs with "
                              "mesh.stage=1")
        module = module.clone(stages=cfg.mesh.stage, microbatches=cfg.mesh.microbatches)
    if user is not None and policy.compute_dtype != np.float32:
        module = adapters.with_compute_dtype(module, policy.compute_dtype,
                                             tuple(cfg.model.keep_fp32))
    return module, user


def lora(cfg, module, sample, mesh):
    """finetune.lora: (model functions with adapters on the targeted weights, the patterns
    that join optim.trainable so only they train, run.json's record of the addition);
    (None, (), {}) when off."""
    if not cfg.finetune.lora.rank:
        return None, (), {}
    fns, extra = lora_lib.to_model_fns(module, cfg, sample, mesh)
    return fns, extra, {"optim.trainable": {"value": [*cfg.optim.trainable, *extra],
                                            "from": "finetune.lora",
                                            "configured": list(cfg.optim.trainable)}}


def model_functions(cfg, module, user, policy, sample, mesh, fns=None) -> Model:
    """The model's init / apply (models.adapters: Linen, NNX or pure; `fns` when LoRA made
    them), its matmuls quantised by model.quant (models.quant); yours computes in the
    policy's dtype (precision.cast_apply)."""
    fns = quant_lib.to_model_fns(module, cfg, sample, mesh, fns)
    name = cfg.model.name if user is None else f"user {_model_name(user, fns)}"
    if user is not None:
        fns = dataclasses.replace(fns, apply=precision_lib.cast_apply(
            fns.apply, policy, tuple(cfg.model.keep_fp32)))
    inputs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        (cfg.data.batch_size,) + np.shape(x), np.asarray(x).dtype), sample)
    return Model(fns, name, inputs, model_flops_per_example(
        user, cfg.model, jax.tree.map(np.shape, sample)), module)


def loss_of(cfg, loss_fn) -> Loss:
    """train()'s loss_fn, else loss.fn / loss.terms, else None (the default loss)."""
    fn, multi = loss_fn, False
    if fn is None:
        fn, multi = loss_terms.from_config(cfg.loss)
    scope = cfg.loss.eval_scope
    return Loss(
        fn, scope == "batch" or (scope == "auto" and multi), tuple(cfg.data.model_inputs),
        data_lib.load_named(cfg.data.valid_fn, "data.valid_fn") if cfg.data.valid_fn else None,
        data_lib.load_named(cfg.eval.predict_fn, "eval.predict_fn")
        if cfg.eval.predict_fn else None)


def optimizer(cfg, given_tx, extra_trainable):
    """(tx, schedule): the optax chain of optim.* (optim.make_optimizer) with the patterns
    LoRA added; a population that varies optim.weight_decay keeps each member's rate in
    the optimizer state. A transformation given to train(tx=...) is the optimizer instead
    (optim.given_optimizer)."""
    if given_tx is None:
        return optim_lib.make_optimizer(cfg.optim, cfg.total_steps,
                                        extra_trainable=extra_trainable,
                                        decay_in_state=population_lib.decay_in_state(cfg))
    if cfg.population.size > 1:
        raise ConfigError("population.size", "a population builds one optimizer per "
                          "member from optim.*; with jtrain.train(tx=...) set "
                          "population.size=1")
    return optim_lib.given_optimizer(given_tx, cfg.optim, cfg.total_steps,
                                     extra_trainable=extra_trainable)


def member_state(cfg, model: Model, tx, policy, mesh):
    """(abstract, shardings, init, policy): shapes before arrays (state.py; leaves without
    logical axes by mesh.auto_shard's rule; optim.ema: the state keeps a weight EMA), the
    fresh state's init, and the policy with what the traced model computes in."""
    try:  # Linen's init calls the model: the first time it meets the data's inputs
        abstract, shardings = state_lib.make_abstract_state(
            model.fns, tx, policy, model.inputs, mesh, cfg.seed,
            auto_shard_min_bytes=mesh_lib.auto_shard_bytes(cfg.mesh),
            ema=cfg.optim.ema.decay > 0)
    except JtrainError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's model: one line, no traceback
        raise model_checks.model_call_error(
            e, model.inputs, model=model.name.removeprefix("user ")) from e
    policy = _measure_precision(policy, cfg, model, abstract.params, mesh)
    return abstract, shardings, functools.partial(
        state_lib.init_state, model.fns, tx, policy, model.inputs, mesh, cfg.seed,
        shardings), policy


def trainable(cfg, params, extra_trainable):
    """Which parameters train (optim.trainable / frozen / lr_mults and LoRA's patterns),
    None when all do: a pattern that matches no parameter is a ConfigError before the
    first step."""
    if not (cfg.optim.trainable or cfg.optim.frozen or cfg.optim.lr_mults
            or extra_trainable):
        return None
    return optim_lib.trainable_split(params, cfg.optim, extra_trainable)


def auto_shard_record(cfg, mesh, abstract, shardings) -> dict:
    """mesh.auto_shard (applied by member_state): with fsdp > 1, run.json records where the
    parameters and the optimizer state were laid out."""
    if not mesh.shape["fsdp"] > 1:
        return {}
    min_bytes = mesh_lib.auto_shard_bytes(cfg.mesh)
    return {"mesh.auto_shard": {
        "value": min_bytes is not None, "from": "mesh.fsdp > 1",
        "params": mesh_lib.layout(abstract.params, shardings.params, min_bytes),
        "opt_state": mesh_lib.layout(abstract.opt_state, shardings.opt_state)}}


def population(cfg, mesh, model: Model, tx, policy, abstract, shardings, init):
    """(population, the whole state's abstract, shardings and init): population.size > 1
    (engine.population) puts the member axis in front of the state (sharded over the data
    axis when it can be) and inits every member; otherwise the member's are the whole's."""
    pop = population_lib.from_config(cfg)
    if pop is None:
        return None, abstract, shardings, init
    pop = population_lib.with_mesh(pop, mesh, shardings)
    whole = population_lib.shardings(pop, shardings)
    return pop, population_lib.abstract(pop, abstract), whole, functools.partial(
        population_lib.init, pop, model.fns, tx, policy, model.inputs, mesh, whole,
        ema=shardings.ema is not None)


def train_metrics(cfg, model: Model, params, example, loss: Loss):
    """log.train_metrics: the eval metrics' definitions on the train step's outputs (their
    states merged exactly over microbatches: train/<name> at log steps), None when off; a
    metric the outputs cannot give is a ConfigError naming the key."""
    if not cfg.log.train_metrics:
        return None
    names = types.SimpleNamespace(metrics=tuple(cfg.log.train_metrics), top_k=cfg.eval.top_k,
                                  max_gathered=cfg.eval.max_gathered)
    try:
        return evaluator.make_spec(names, model.fns.apply, params, model.inputs, example,
                                   predict_fn=loss.predict_fn, model_inputs=loss.model_inputs)
    except ConfigError as e:
        raise ConfigError("log.train_metrics", e.why) from None


def memory_plan(cfg, mesh, train_example, state_abstract, step_of):
    """(plan, grad_accum_steps, run.json's record): with a memory budget
    (memory.budget_bytes, or what the device reports) and a training example, the smallest
    grad_accum_steps whose compiled step (`step_of(accum)`) fits (control.memory);
    (None, optim.grad_accum_steps, {}) otherwise."""
    accum = cfg.optim.grad_accum_steps
    budget, source = memory_lib.device_budget(cfg.memory.budget_bytes, mesh.devices.flat[0])
    if budget is None or train_example is None:
        return None, accum, {}
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        (cfg.data.batch_size,) + np.shape(x), np.asarray(x).dtype), train_example)

    def measure(n):  # traced as the loop traces it: logical names on this mesh
        with mesh_lib.model_context(mesh):
            return memory_lib.step_bytes(step_of(n).lower(state_abstract, batch).compile())

    plan = memory_lib.plan(measure, per_device_batch=cfg.data.batch_size
                           // mesh_lib.data_parallel_size(mesh),
                           configured=accum, budget=budget, source=source)
    return plan, plan.accum, {"optim.grad_accum_steps": {
        "value": plan.accum, "from": "memory plan", "configured": accum}}


def train_step_of(cfg, mesh, model: Model, loss: Loss, tx, schedule, policy, shardings,
                  pop, metrics_spec, grad_accum_steps: int):
    """The built-in update (step.make_train_step: the EMA moved with optim.ema, the train
    metrics' states with log.train_metrics), a population's vmapped over the member axis,
    jitted with the whole state's `shardings` and the state donated;
    determinism.topology_invariant's programs for one device otherwise."""
    ema = cfg.optim.ema
    apply, loss_fn, predict_fn = moe_train_parts(cfg, model, loss)
    step = step_lib.make_train_step(
        apply, loss_fn, tx, schedule,
        grad_accum_steps=grad_accum_steps, dynamic_loss_scale=policy.dynamic_loss_scale,
        halt_on_nonfinite=cfg.nonfinite.policy == "halt",
        max_consecutive=cfg.nonfinite.max_consecutive, valid_fn=loss.valid_fn,
        model_inputs=loss.model_inputs, invariant=invariant_of(cfg, mesh, shardings),
        **({"ema_decay": float(ema.decay), "ema_warmup": str(ema.warmup)}
           if ema.decay > 0 else {}),
        **({"train_metrics": metrics_spec, "predict_fn": predict_fn}
           if metrics_spec is not None else {}))
    if isinstance(step, invariant.SplitStep):  # several programs: nothing to jit or donate
        return step
    if pop is not None:
        step = population_lib.train_step(pop, step)
    return jax.jit(step, in_shardings=(shardings, mesh_lib.batch_sharding(mesh)),
                   out_shardings=(shardings, mesh_lib.replicated(mesh)), donate_argnums=0)


def moe_train_parts(cfg, model: Model, loss: Loss):
    """(apply, loss fn, predict_fn) of the training step: the model's, or with the built-in
    transformer's MoE blocks (model.moe.experts > 0) the forward that returns their
    sown totals and the loss with model.moe.aux_weight's term (models.moe)."""
    fn = loss.fn or losses.default_loss
    if model.name != "transformer" or not cfg.model.moe.experts:
        return model.fns.apply, fn, loss.predict_fn
    return moe_lib.with_moe_terms(model.module, fn, loss.predict_fn, cfg.model.moe.aux_weight)


def eval_steps(cfg, mesh, apply, loss: Loss, spec, params_shardings, *, forward=None):
    """(eval_step, eval_tail): the pure eval step (step.make_eval_step: `spec`'s metrics,
    the loss's terms) jitted with the batch sharded, or determinism.topology_invariant's
    chunked form; and for a batch-level loss of yours (loss.eval_scope) the same step on
    replicated rows, so a partial last batch is scored at its true size (None otherwise)."""
    fn = step_lib.make_eval_step(
        apply, loss.fn or losses.default_loss, user_loss=loss.fn is not None, metrics=spec,
        model_inputs=loss.model_inputs, predict_fn=loss.predict_fn, batch_loss=loss.batch,
        **({"forward": forward} if forward is not None else {}))
    repl = mesh_lib.replicated(mesh)
    tail = (jax.jit(fn, in_shardings=(params_shardings, repl), out_shardings=repl)
            if loss.batch and loss.fn is not None else None)
    chosen = invariant_of(cfg, mesh)
    if chosen is not None:
        return invariant.SplitEval(fn, *chosen), tail
    batch_sharding = mesh_lib.batch_sharding(mesh)
    return jax.jit(fn, in_shardings=(params_shardings, batch_sharding),
                   out_shardings=(repl, batch_sharding, repl)), tail


def invariant_of(cfg, mesh, *extra):
    """(mesh, chunks, *extra) for determinism.topology_invariant, None when off; a
    ConfigError for what the mode does not cover."""
    det = cfg.determinism
    if not det.topology_invariant:
        return None
    for axis in ("tensor", "expert"):
        if mesh.shape[axis] > 1:
            raise ConfigError("determinism.topology_invariant", f"not implemented with "
                              f"mesh.{axis}={mesh.shape[axis]}; use the data and fsdp axes")
    if cfg.population.size > 1:
        raise ConfigError("determinism.topology_invariant", "not implemented for a "
                          "population (population.size > 1)")
    rows = cfg.data.batch_size
    n = mesh_lib.data_parallel_size(mesh)
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
    return (mesh, det.chunks, *extra)


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


def _measure_precision(policy, cfg, model: Model, params, mesh):
    """The policy with what the traced forward computes in (precision.matmul_dtypes);
    unchanged when the model cannot be traced here (model_checks reports that).
    model.quant on a model with no quantised matmul is refused (models.quant.check)."""
    try:
        with mesh_lib.model_context(mesh):
            matmuls = precision_lib.matmul_dtypes(model.fns.apply, params, model.inputs)
    except Exception:  # noqa: BLE001 - check_run calls the model and says what is wrong
        return policy
    quant_lib.check(cfg.model.quant, matmuls, model.name)
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
