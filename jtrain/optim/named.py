"""Any optax / optax.contrib transformation by name: `optim.name = "optax.lion"` or
`"optax.contrib.sophia"` with `optim.kwargs = {...}`.

A name is looked up with getattr on the `optax` or `optax.contrib` module and nothing
else: a config is data, so it never imports a module (jtrain.observe.trust). The
factory's own arguments come from `optim.kwargs`; jtrain passes the ones it owns when the
factory takes them: `learning_rate` (the schedule of optim.lr / optim.schedule) and, with
optim.weight_decay > 0, `weight_decay` with the decay mask (`mask` or
`weight_decay_mask`). Clipping, freezing, lr_mults and accumulation wrap the result as
for the built-in names (jtrain.optim.make_optimizer).
"""

import inspect

import jax
import jax.numpy as jnp
import optax

from jtrain.errors import ConfigError

PREFIXES = ("optax.contrib.", "optax.")
# Keys jtrain fills itself: in optim.kwargs they would fight optim.lr / weight_decay.
_OWNED = {"learning_rate": "optim.lr and optim.schedule",
          "weight_decay": "optim.weight_decay", "mask": "optim.decay_embeddings",
          "weight_decay_mask": "optim.decay_embeddings"}


def is_optax_name(name: str) -> bool:
    return name.startswith("optax.")


def factory(name: str):
    """The optax function `name` names; ConfigError naming optim.name when there is none
    or it is not a function."""
    module, attr = ((optax.contrib, name.removeprefix("optax.contrib."))
                    if name.startswith("optax.contrib.") else
                    (optax, name.removeprefix("optax.")))
    fn = None if "." in attr or attr.startswith("_") else getattr(module, attr, None)
    if fn is None:
        where = "optax.contrib" if module is optax.contrib else "optax"
        raise ConfigError("optim.name", f"{where} has no public function {attr!r} "
                                        f"(names look like optax.lion, optax.contrib.muon)")
    if isinstance(fn, type) or not inspect.isfunction(fn):
        raise ConfigError("optim.name", f"{name} is not a function returning an "
                                        "optax.GradientTransformation")
    return fn


def build(name: str, kwargs: dict, schedule, wd: float, mask) -> optax.GradientTransformation:
    """`name(**kwargs)` with the learning rate (and weight decay) jtrain owns; ConfigError
    naming optim.kwargs.<arg> for an argument it does not take or a value it refuses."""
    fn = factory(name)
    params = inspect.signature(fn).parameters
    takes_var = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for arg in kwargs:
        if arg in _OWNED:
            raise ConfigError(f"optim.kwargs.{arg}", f"set by jtrain from "
                              f"{_OWNED[arg]}; set that instead")
        if arg not in params and not takes_var:
            raise ConfigError(f"optim.kwargs.{arg}", f"{name} takes no argument {arg!r}; "
                              f"it takes: {', '.join(params) or 'none'}")
    args = dict(kwargs)
    if "learning_rate" in params:
        args["learning_rate"] = schedule
    if wd > 0:
        if "weight_decay" not in params:
            raise ConfigError("optim.weight_decay", f"{name} takes no weight_decay "
                              "argument; set optim.weight_decay=0 or chain "
                              "optax.add_decayed_weights yourself (jtrain.train(tx=...))")
        args["weight_decay"] = wd
        for key in ("mask", "weight_decay_mask"):
            if key in params:
                args[key] = mask
    missing = [n for n, p in params.items() if p.default is p.empty
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in args]
    if missing:
        raise ConfigError(f"optim.kwargs.{missing[0]}", f"required by {name} (an optax "
                          "function returning a GradientTransformation?)")
    try:
        tx = fn(**args)
    except Exception as e:  # noqa: BLE001  (the factory's own check of its arguments)
        raise ConfigError("optim.kwargs", f"{name}({_shown(args)}) raised "
                          f"{type(e).__name__}: {e}") from None
    if not isinstance(tx, optax.GradientTransformation):
        raise ConfigError("optim.name", f"{name} returned a {type(tx).__name__}, not an "
                                        "optax.GradientTransformation")
    _check_traces(name, args, tx)
    return tx


def _check_traces(name: str, args: dict, tx) -> None:
    """Trace init and one update on a tiny tree (no compute): a value the factory took but
    the update cannot use is a line before step 1, not a traceback inside the step."""
    tree = {"b": jax.ShapeDtypeStruct((3,), jnp.float32),
            "w": jax.ShapeDtypeStruct((3, 3), jnp.float32)}

    def one(p):
        return tx.update(p, tx.init(p), p)

    try:
        jax.eval_shape(one, tree)
    except Exception as e:  # noqa: BLE001
        raise ConfigError("optim.kwargs", f"{name}({_shown(args)}) cannot update "
                          f"parameters: {type(e).__name__}: {str(e).splitlines()[0]}") from None


def _shown(args: dict) -> str:
    def shown(k, v):
        return "<schedule>" if k == "learning_rate" else "<mask>" if "mask" in k else repr(v)

    return ", ".join(f"{k}={shown(k, v)}" for k, v in args.items())
