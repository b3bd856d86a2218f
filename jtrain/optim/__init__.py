"""Optimizers and learning-rate schedules: the only reader of `config.optim`
(docs/guide/optimizers.md, docs/guide/schedules.md).

`make_optimizer(config.optim, total_steps) -> (tx, schedule)` builds one optax chain:

    clip_by_global_norm(clip_norm)       # only when clip_norm > 0
    -> optimizer(learning_rate=schedule) # weight decay inside, masked by `weight_decay_mask`

`schedule` is the very object inside `tx`, so `schedule(step)` is the learning rate the
update at `step` used. Freezing (`optim.trainable` / `optim.frozen`, regexes searched in
`leaf_path`s) runs that chain inside `optax.multi_transform` on the trainable leaves
only: frozen leaves get `set_to_zero()`, never move, carry no optimizer state and do not
count in the clipping norm. `optim.lr_mults` ({regex: factor}, first match wins)
multiplies the updates of matching leaves. Adafactor's `weight_decay_rate` applies after
the learning rate, so it gets `wd * schedule(count)`. Schedule-free: the params are the
gradient points, evaluation and export use the average (`schedule_free_eval_params`).
`grad_accum_steps` is the step builder's, not read here.

A name of optax / optax.contrib ("optax.lion", with `optim.kwargs`) takes the
optimizer's place in the chain (named.py); `jtrain.train(tx=...)` replaces the whole
chain but freezing and lr_mults (`given_optimizer`). The modules: schedules.py,
decay.py (a weight-decay rate in the optimizer state, one per population member),
named.py and update.py (one update from gradients summed over microbatches).
"""

import functools
import math
import re

import jax
import jax.numpy as jnp
import optax

from jtrain.config import sections
from jtrain.config.fields import OPTIMIZERS as FIELD_OPTIMIZERS, SCHEDULE_FREE  # noqa: F401
from jtrain.errors import ConfigError
from jtrain.optim import decay as optim_decay
from jtrain.optim import named
from jtrain.optim.schedules import _SCHEDULES, SCHEDULES, make_schedule  # noqa: F401


def _key_name(key):
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    return ""  # sequence / flattened indices name nothing


def weight_decay_mask(params, *, decay_embeddings):
    """True for the leaves weight decay applies to: matrices and higher (ndim >= 2).

    Biases, norm scales and scalars (ndim < 2) are never decayed; embedding tables (any
    key on the leaf's path containing "embed", case-insensitive) only when
    `decay_embeddings`. Works on plain dicts, flax `nn.LogicallyPartitioned` boxes and
    NNX `nnx.State` (the mask keeps the boxes, with a bool inside), and on abstract
    arrays, since it reads only `ndim` and the path.
    """

    def decays(path, leaf):
        if jnp.ndim(leaf) < 2:
            return False
        is_embedding = any("embed" in _key_name(k).lower() for k in path)
        return decay_embeddings or not is_embedding

    return jax.tree_util.tree_map_with_path(decays, params)


# Optimizers: name -> builder(optim_cfg, schedule, weight_decay, mask) -> tx.
def _adamw(cfg, schedule, wd, mask):
    return optax.adamw(
        schedule, b1=cfg["b1"], b2=cfg["b2"], eps=cfg["eps"],
        weight_decay=wd, mask=mask,
    )


def _adam(cfg, schedule, wd, mask):
    del wd, mask  # weight decay with adam is a ConfigError (jtrain.config.check_optim)
    return optax.adam(schedule, b1=cfg["b1"], b2=cfg["b2"], eps=cfg["eps"])


def _sgd(cfg, schedule, wd, mask):
    sgd = optax.sgd(schedule, momentum=float(cfg["kwargs"]["momentum"]) or None,  # 0: none
                    nesterov=bool(cfg["kwargs"]["nesterov"]))
    if wd <= 0:
        return sgd
    return optax.chain(optax.add_decayed_weights(wd, mask=mask), sgd)


def _lion(cfg, schedule, wd, mask):
    return optax.lion(schedule, b1=cfg["b1"], b2=cfg["b2"], weight_decay=wd, mask=mask)


def _adafactor(cfg, schedule, wd, mask):
    del cfg
    # adafactor adds `rate * p` after the learning-rate scaling: scale it by the
    # schedule so weight_decay means the same as in adamw (p -= lr * wd * p).
    rate = (lambda count: wd * schedule(count)) if wd > 0 else None
    return optax.adafactor(learning_rate=schedule, weight_decay_rate=rate, weight_decay_mask=mask)


def _muon(cfg, schedule, wd, mask):
    # optax's own 2-D rule, split out here so the adam half takes the decay mask too.
    muon = optax.contrib.muon(schedule, ns_steps=int(cfg["kwargs"]["ns_steps"]),
                              beta=cfg["kwargs"]["beta"], eps=cfg["eps"], weight_decay=wd,
                              weight_decay_mask=mask)
    adam = optax.adamw(schedule, b1=cfg["b1"], b2=cfg["b2"], eps=cfg["eps"],
                       weight_decay=wd, mask=mask, nesterov=True)
    return optax.partition({"muon": muon, "adam": adam}, muon_labels)


def muon_labels(params):
    """"muon" for the 2-D leaves, "adam" for the rest (optax.contrib.muon's rule)."""
    return jax.tree.map(lambda x: "muon" if jnp.ndim(x) == 2 else "adam", params)


def _prodigy(cfg, schedule, wd, mask):
    tx = optax.contrib.prodigy(schedule, betas=(cfg["b1"], cfg["b2"]), eps=cfg["eps"],
                               estim_lr0=cfg["kwargs"]["estim_lr0"])
    if wd <= 0:
        return tx
    b1, b2 = cfg["b1"], cfg["b2"]

    def update(updates, state, params=None, **extra):
        # prodigy's own decay term (-wd * dlr * p, dlr from the incoming state), masked.
        new, new_state = tx.update(updates, state, params, **extra)
        count = optax.safe_increment(state.count)
        bc = ((1 - b2**count) ** 0.5) / (1 - b1**count)
        dlr = jnp.asarray(state.estim_lr * schedule(state.count) * bc, state.estim_lr.dtype)
        return jax.tree.map(lambda u, p, m: u - wd * dlr * p if m else u,
                            new, params, mask(params)), new_state

    return optax.GradientTransformationExtraArgs(tx.init, update)


def _schedule_free_adamw(cfg, schedule, wd, mask, tail=(), rms=True):
    rms = (optax.scale_by_rms(decay=cfg["b2"], eps=cfg["eps"], eps_in_sqrt=False,
                              bias_correction=True),) if rms else ()
    base = optax.chain(*rms, optax.add_decayed_weights(wd, mask),
                       optax.scale_by_learning_rate(schedule), *tail)
    return optax.contrib.schedule_free(base, learning_rate=schedule, b1=cfg["b1"])


_schedule_free_sgd = functools.partial(_schedule_free_adamw, rms=False)


# Each built-in name of the one list (jtrain.config.fields.OPTIMIZERS) is built by the
# function of that name above, with a leading underscore.
_OPTIMIZERS = {name: globals()[f"_{name}"] for name in FIELD_OPTIMIZERS}
OPTIMIZERS = tuple(_OPTIMIZERS)


def leaf_path(path) -> str:
    """A parameter's path in the params tree (`blocks_0/attn/qkv/kernel`, no `params/`):
    the one string every parameter pattern is matched against (optim.trainable / frozen /
    lr_mults, init.exclude / init.map, finetune.lora.targets) and the tensor
    name of an export."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


def check_patterns(key: str, patterns, names, what: str = "parameter path",
                   like: str = "paths") -> None:
    """ConfigError naming `key` for the first regex in `patterns` that re.search finds in
    none of `names` (parameter paths, unless `what` says otherwise): a pattern that
    selects nothing is a typo or another convention, never a silent no-op."""
    names = list(names)
    for pattern in patterns:
        if not any(re.search(pattern, name) for name in names):
            example = ", ".join(repr(name) for name in names[:3]) or "none"
            raise ConfigError(key, f"{pattern!r} matches no {what}; {like} look like "
                                   f"{example}")


def trainable_labels(params, trainable=(), frozen=()):
    """"train" or "frozen" per leaf: with `trainable`, only leaves matching one of its
    regexes train; leaves matching a `frozen` regex never do."""
    keep = [re.compile(p) for p in trainable]
    drop = [re.compile(p) for p in frozen]

    def label(path, leaf):
        del leaf
        name = leaf_path(path)
        if keep and not any(r.search(name) for r in keep):
            return "frozen"
        return "frozen" if any(r.search(name) for r in drop) else "train"

    return jax.tree_util.tree_map_with_path(label, params)


def trainable_split(params, optim_cfg, extra_trainable=()) -> dict:
    """{"train": (leaves, values), "frozen": (leaves, values)} for the header; raises
    ConfigError naming a regex that matches no leaf, or when nothing would train.
    `extra_trainable`: patterns added to optim.trainable by the run (LoRA's adapters).
    `decay_in_state`: the weight decay rate in the state (jtrain.optim.decay)."""
    flat = [(leaf_path(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]]
    for key in ("trainable", "frozen", "lr_mults"):
        check_patterns(f"optim.{key}", optim_cfg[key], [name for name, _ in flat])
    labels = jax.tree.leaves(trainable_labels(
        params, (*optim_cfg["trainable"], *extra_trainable), optim_cfg["frozen"]))
    out = {"train": [0, 0], "frozen": [0, 0]}
    for label, (_, leaf) in zip(labels, flat, strict=True):
        out[label][0] += 1
        out[label][1] += int(math.prod(leaf.shape))
    if not out["train"][0]:
        raise ConfigError("optim.trainable", "no parameter is left to train (every leaf is "
                                             "frozen by optim.trainable / optim.frozen)")
    return {k: tuple(v) for k, v in out.items()}


def _scale_by_path(mults: dict) -> optax.GradientTransformation:
    """Multiplies each leaf's update by the factor of the first regex in `mults` that
    its path matches (1 when none does)."""
    compiled = [(re.compile(p), float(f)) for p, f in mults.items()]

    def factor(path):
        name = leaf_path(path)
        return next((f for r, f in compiled if r.search(name)), 1.0)

    def update(updates, state, params=None):
        del params
        return jax.tree_util.tree_map_with_path(
            lambda path, u: u if factor(path) == 1.0 else u * jnp.asarray(factor(path), u.dtype),
            updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _scale_by_lr_factor() -> optax.GradientTransformationExtraArgs:
    """Multiplies the updates by the `lr_factor` extra argument of `update` (the state's
    plateau / spike factor), inside a schedule-free optimizer's base step."""

    def update(updates, state, params=None, *, lr_factor=None, **extra):
        del params, extra
        if lr_factor is None:
            return updates, state
        return jax.tree.map(lambda u: (u * lr_factor).astype(u.dtype), updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


class _TakesLrFactor(optax.GradientTransformationExtraArgs):
    """A tx whose `update` applies `lr_factor=` itself (schedule-free)."""


def takes_lr_factor(tx) -> bool:
    """True when the step passes `lr_factor=` to `tx.update` instead of scaling its
    updates (jtrain.step)."""
    return isinstance(tx, _TakesLrFactor)


def schedule_free_eval_params(opt_state, params):
    """The parameters a schedule-free optimizer evaluates at (the average x, computed from
    the step's y and the state's z, as optax.contrib.schedule_free_eval_params), or None
    for other optimizers. Frozen leaves (no z) are the params as they are."""
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=_is_sf_state)
             if _is_sf_state(s)]
    if not found:
        return None
    return _schedule_free_average(params, found[0].z, found[0].b1)


@jax.jit
def _schedule_free_average(params, z, b1):
    """Jitted: eager ops would compile three times per leaf shape at the first eval."""
    return jax.tree.map(
        lambda y, z: y if isinstance(z, optax.MaskedNode) else (y - (1.0 - b1) * z) / b1,
        params, z)


def _is_sf_state(x) -> bool:
    return isinstance(x, optax.contrib.ScheduleFreeState)


def make_optimizer(optim_cfg, total_steps, *, extra_trainable=(), decay_in_state=False):
    """Returns `(tx, schedule)`; `schedule` is the one inside `tx` (log `schedule(step)`).

    `optim_cfg`: the `optim` section, whole or partial (`{"name": "sgd", "lr": 0.1}`):
    the schema's defaults fill the rest; a ConfigError names an unknown key or a bad
    value.
    `extra_trainable`: patterns added to optim.trainable by the run (LoRA's adapters).
    `decay_in_state`: the weight decay rate in the state (jtrain.optim.decay).

    Examples:
        ```python
        import jtrain

        tx, schedule = jtrain.make_optimizer({"name": "adamw", "lr": 1e-3,
                                              "warmup_steps": 100}, total_steps=1000)
        opt_state = tx.init(params)
        print(schedule(100))        # the peak learning rate
        ```
    """
    optim_cfg = sections.section("optim", optim_cfg, total_steps=total_steps)
    name = optim_cfg["name"]
    schedule = make_schedule(optim_cfg, total_steps)
    wd = float(optim_cfg["weight_decay"])
    mask = functools.partial(weight_decay_mask,
                             decay_embeddings=bool(optim_cfg["decay_embeddings"]))
    mults = (_scale_by_path(dict(optim_cfg["lr_mults"])),) if optim_cfg["lr_mults"] else ()
    if name in SCHEDULE_FREE:  # lr_mults and the plateau factor scale the base step
        tx = _OPTIMIZERS[name](optim_cfg, schedule, wd, mask,
                               tail=(*mults, _scale_by_lr_factor()))
    elif named.is_optax_name(name):
        tx = named.build(name, dict(optim_cfg["kwargs"]), schedule, wd, mask)
        tx = optax.chain(tx, *mults) if mults else tx
    else:
        tx = (optim_decay.optimizer(name, optim_cfg, schedule, wd, mask) if decay_in_state
              else _OPTIMIZERS[name](optim_cfg, schedule, wd, mask))
        tx = optax.chain(tx, *mults) if mults else tx
    clip_norm = float(optim_cfg["clip_norm"])
    if clip_norm > 0:
        tx = optax.chain(optax.clip_by_global_norm(clip_norm), tx)
    tx = _frozen_apart(tx, optim_cfg, extra_trainable)
    if name in SCHEDULE_FREE:
        tx = _TakesLrFactor(tx.init, tx.update)
    return tx, schedule


def _frozen_apart(tx, optim_cfg, extra_trainable):
    """`tx` for the trainable leaves only: optim.trainable / frozen (and what LoRA adds)
    get no update and keep no optimizer state."""
    trainable = (*optim_cfg["trainable"], *extra_trainable)
    if not (trainable or optim_cfg["frozen"]):
        return tx
    return optax.multi_transform(
        {"train": tx, "frozen": optax.set_to_zero()},
        functools.partial(trainable_labels, trainable=trainable,
                          frozen=tuple(optim_cfg["frozen"])))


# What optim.* still means with train(tx=...): the step's accumulation and EMA, and the
# freezing and lr_mults wrapped around the given transformation. Every other key
# configures the built-in chain, and a non-default value would be silently ignored.
_WITH_TX = ("grad_accum_steps", "trainable", "frozen", "lr_mults", "ema")


def given_optimizer(tx, optim_cfg, total_steps, *, extra_trainable=()):
    """`(tx, schedule)` for a transformation passed as `jtrain.train(tx=...)`: `tx` with
    optim.lr_mults and optim.trainable / frozen around it as for a built-in name;
    `schedule` logs NaN (the learning rate is inside `tx`). ConfigError naming the first
    optim key that would be ignored."""
    if not isinstance(tx, optax.GradientTransformation):
        raise ConfigError("tx", f"must be an optax.GradientTransformation, got "
                                f"{type(tx).__name__}")
    optim_cfg = sections.section("optim", optim_cfg, total_steps=total_steps)
    defaults = sections.section("optim", {}, total_steps=total_steps)
    for key in sorted(optim_cfg, key=lambda k: k != "name"):  # the name before its kwargs
        if key not in _WITH_TX and optim_cfg[key] != defaults[key]:
            raise ConfigError(f"optim.{key}", f"{optim_cfg[key]!r} would be ignored: "
                              "jtrain.train(tx=...) is the whole optimizer; leave "
                              f"optim.{key} at its default or build it into tx")
    if optim_cfg["lr_mults"]:
        tx = optax.chain(tx, _scale_by_path(dict(optim_cfg["lr_mults"])))
    tx = _frozen_apart(tx, optim_cfg, extra_trainable)
    return tx, lambda count: jnp.full((), jnp.nan, jnp.float32)

