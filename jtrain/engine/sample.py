"""`jtrain sample RUN --prompt TEXT`: text from a trained language model.

    sample(run_or_params, prompts, *, model=None, max_new_tokens=64, temperature=0.0,
           top_k=0, top_p=1.0, seed=0, stop=(), step=None, use_cache=True) -> [Sample]

The run's newest intact checkpoint (or `step`: N, latest, best) is read like `jtrain
export` reads it (integrity-checked, params only) into the model its config.json names;
nothing the run names is imported unless the run is trusted (jtrain.observe.trust), and
then only its model.factory.

The decode interface, what a model must have to be sampled (the built-in transformer has
it, jtrain/models/transformer.py): `max_len` (its context), `init_cache(batch, length)`
(an empty cache pytree) and `apply(variables, tokens [B, T], cache=cache, pad=pad [B])
-> (logits [B, T, V], cache)`, which runs T tokens at the cache's index with each row
left-padded by pad tokens. Any other model is refused in one line.

Decoding: prompts of different lengths are left-padded to the longest (each row's own
rotary positions start at its first real token; padding is masked out of attention);
the prompt runs in one call (prefill), then one token per call into a cache of fixed
length (longest prompt + max_new_tokens, at most the context), so each of the two jitted
functions compiles once per batch. `use_cache=False` recomputes the whole window every
token instead (the reference the cache is tested against; the benchmark's other side).
Token choice, in the step: temperature 0 is greedy (argmax); otherwise logits /
temperature, keep the `top_k` largest (0: all), then the smallest set whose
probabilities reach `top_p` (1: all), and draw with the key of `seed` folded with the
cache index: the same seed, prompts and settings give the same tokens.

A byte-level model (vocab_size 256) takes text, its UTF-8 bytes as tokens, and returns
text (invalid UTF-8 replaced); any model takes prompts as lists of token ids. A row ends
at a stop string (cut before it), at max_new_tokens, or when the context is full.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jtrain.errors import ExportError, UsageError, message

INTERFACE = "max_len, init_cache(batch, length), __call__(tokens, cache=, pad=)"


@dataclasses.dataclass(frozen=True)
class Sample:
    """One prompt's continuation, as `jtrain.sample` returns it.

    Attributes:
        tokens: the new token ids (a stop string cut off).
        text: those tokens as UTF-8 text (invalid bytes replaced) for a byte-level model
            (vocab_size 256); None for other vocabularies.
        finish: "stop" (a stop string), "length" (max_new_tokens) or "context" (the
            model's context was full).

    Examples:
        ```python
        import jtrain

        s = jtrain.sample("runs/base", "def ", max_new_tokens=8)[0]
        print(repr(s.text), s.finish)   # e.g. 'main():' length
        ```
    """
    tokens: list[int]
    text: str | None
    finish: str


def sample(run_or_params, prompts, *, model=None, max_new_tokens: int = 64,
           temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
           stop=(), step=None, use_cache: bool = True) -> list[Sample]:
    """Continues each prompt (a str, or a list of them / of token-id lists) with the
    model of a run directory (`run_or_params` a path; `model=` for a run trained with a
    model passed from Python) or of params you hold (`model=` the module, required).
    See the module docstring.

    Examples:
        ```python
        import jtrain

        out = jtrain.sample("runs/base", ["def main(", "import "], max_new_tokens=40,
                            temperature=0.8, top_p=0.95, seed=1, stop=["\\n\\n"])
        print(out[0].text, out[0].finish)
        ```
    """
    if isinstance(run_or_params, (str, os.PathLike)):
        model, params = open_run(os.fspath(run_or_params), step=step, model=model)
    else:
        if model is None:
            raise UsageError("model", "required with params: the module they belong to")
        check_interface(model, "model")
        params = run_or_params
    params = params if "params" in params else {"params": params}
    rows = encode(prompts, model)
    check(rows, model, max_new_tokens, temperature, top_k, top_p)
    decoder = Decoder(model)
    return decoder.generate(params, rows, max_new_tokens=max_new_tokens, seed=seed,
                            settings=(temperature, top_k, top_p), stop=stop,
                            use_cache=use_cache)


def byte_level(model) -> bool:
    return getattr(model, "vocab_size", None) == 256


def encode(prompts, model) -> list[list[int]]:
    """Token rows of the prompts: text as UTF-8 bytes (a byte-level model), or ids."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not prompts:
        raise UsageError("--prompt", "required: the text to continue")
    rows = []
    for p in prompts:
        if isinstance(p, str):
            if not byte_level(model):
                raise UsageError("--prompt", "text is the byte-level model's (vocab_size "
                                 "256); give this model lists of token ids")
            p = list(p.encode("utf-8"))
        if not p:
            raise UsageError("--prompt", "empty: give at least one token to continue")
        rows.append([int(t) for t in p])
    return rows


def check(rows, model, max_new_tokens, temperature, top_k, top_p) -> None:
    """One UsageError per setting out of range, and per prompt longer than the context."""
    context = int(model.max_len)
    for row in rows:
        if len(row) > context:
            raise UsageError("--prompt", f"{len(row)} tokens, the model's context is "
                             f"{context}")
    for flag, ok, want in (("--max_new_tokens", max_new_tokens >= 1, ">= 1"),
                           ("--temperature", temperature >= 0, ">= 0"),
                           ("--top_k", top_k >= 0, ">= 0 (0: all)"),
                           ("--top_p", 0 < top_p <= 1, "in (0, 1]")):
        if not ok:
            raise UsageError(flag, f"must be {want}")


def check_interface(model, where: str) -> None:
    missing = [n for n in ("max_len", "init_cache") if not hasattr(model, n)]
    if missing:
        raise UsageError(where, f"{type(model).__name__} has no {', '.join(missing)}: "
                         f"sampling needs the decode interface ({INTERFACE}; "
                         "docs/guide/language-models.md)")


def choose(logits, key, temperature, top_k, top_p, greedy: bool):
    """The next token of each row from logits [B, V] (module docstring: token choice)."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B]
    logits = logits / temperature
    v = logits.shape[-1]
    ranked = jnp.sort(logits, axis=-1)[:, ::-1]  # [B, V], largest first
    k = jnp.where((top_k > 0) & (top_k < v), top_k, v)
    ranked = jnp.where(jnp.arange(v) < k, ranked, -jnp.inf)  # top-k
    probs = jax.nn.softmax(ranked, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the larger ones
    kept = jnp.sum((before < top_p) & (jnp.arange(v) < k), axis=-1)  # [B], >= 1
    floor = jnp.take_along_axis(ranked, kept[:, None] - 1, axis=-1)  # [B, 1]
    return jax.random.categorical(key, jnp.where(logits >= floor, logits, -jnp.inf)
                                  ).astype(jnp.int32)


class Decoder:
    """The jitted prefill, step and window functions of one model; `generate` reuses
    their compilations across calls with the same batch and lengths."""

    def __init__(self, model):
        self.model = model
        self._prefill = jax.jit(self.prefill, static_argnames="greedy")
        self._step = jax.jit(self.step, static_argnames="greedy", donate_argnums=2)
        self._window = jax.jit(self.window, static_argnames="greedy")

    def prefill(self, params, tokens, cache, pad, key, settings, greedy):
        """The prompts [B, P] into the cache; (first new token [B], cache)."""
        logits, cache = self.model.apply(params, tokens, cache=cache, pad=pad)
        return choose(logits[:, -1], jax.random.fold_in(key, cache["index"]), *settings,
                      greedy), cache

    def step(self, params, token, cache, pad, key, settings, greedy):
        """One token per row [B] at the cache's index; (next token [B], cache)."""
        logits, cache = self.model.apply(params, token[:, None], cache=cache, pad=pad)
        return choose(logits[:, 0], jax.random.fold_in(key, cache["index"]), *settings,
                      greedy), cache

    def window(self, params, tokens, pad, length, key, settings, greedy):
        """Without a cache: the whole window [B, S] recomputed, the token after the
        first `length` chosen, drawn with the key the cached step would use."""
        cache = self.model.init_cache(*tokens.shape)
        logits, _ = self.model.apply(params, tokens, cache=cache, pad=pad)
        last = jax.lax.dynamic_index_in_dim(logits, length - 1, axis=1, keepdims=False)
        return choose(last, jax.random.fold_in(key, length), *settings, greedy)

    def generate(self, params, rows, *, max_new_tokens, seed, settings, stop=(),
                 use_cache=True) -> list[Sample]:
        width = max(map(len, rows))
        size = min(int(self.model.max_len), width + max_new_tokens)
        pad = np.array([width - len(r) for r in rows], np.int32)
        buf = np.zeros((len(rows), size), np.int32)
        for i, r in enumerate(rows):
            buf[i, pad[i]:width] = r
        greedy = float(settings[0]) == 0.0
        knobs = (jnp.float32(settings[0] or 1.0), jnp.int32(settings[1]),
                 jnp.float32(settings[2]))
        key, pad_d = jax.random.key(seed), jnp.asarray(pad)
        stops = [s.encode("utf-8") for s in ([stop] if isinstance(stop, str) else stop) if s]
        if stops and not byte_level(self.model):
            raise UsageError("--stop", "stop strings need the byte-level model (vocab_size "
                             "256)")
        out: list[list[int]] = [[] for _ in rows]
        done: list[str | None] = [None] * len(rows)
        cache = None
        for n in range(size - width):
            if use_cache and cache is None:
                token, cache = self._prefill(params, jnp.asarray(buf[:, :width]),
                                             self.model.init_cache(len(rows), size), pad_d,
                                             key, knobs, greedy=greedy)
            elif use_cache:
                token, cache = self._step(params, token, cache, pad_d, key, knobs,
                                          greedy=greedy)
            else:
                token = self._window(params, jnp.asarray(buf), pad_d, jnp.int32(width + n),
                                     key, knobs, greedy=greedy)
            got = np.asarray(token)
            buf[:, width + n] = got
            for i, t in enumerate(got.tolist()):
                if done[i] is None:
                    out[i].append(t)
                    done[i] = _stopped(out[i], stops)
            if all(done):
                break
        finish = "length" if width + max_new_tokens <= size else "context"
        return [Sample(tokens=toks, text=(bytes(toks).decode("utf-8", errors="replace")
                                          if byte_level(self.model) else None),
                       finish=("stop" if done[i] == "stop" else finish))
                for i, toks in enumerate(out)]


def _stopped(tokens: list[int], stops: list[bytes]) -> str | None:
    """"stop" when the row's bytes now end a stop string (cut from `tokens` in place)."""
    tail = bytes(tokens[-max(map(len, stops), default=0):]) if stops else b""
    for s in stops:
        if tail.endswith(s):
            del tokens[len(tokens) - len(s):]
            return "stop"
    return None


def open_run(workdir: str, *, step=None, model=None) -> tuple[Any, dict]:
    """(model, {"params": ...}) of a run's checkpoint; one line for a run that cannot be
    sampled (not a run, a population, LoRA adapters, a step of your own, a model
    without the decode interface or passed from Python, a damaged checkpoint)."""
    from flax import traverse_util
    from flax.core import meta

    from jtrain import config as config_lib
    from jtrain import models as models_lib
    from jtrain import precision as precision_lib
    from jtrain.checkpoint import export as export_lib
    from jtrain.checkpoint.integrity import leaf_path
    from jtrain.engine.replay import read_run
    from jtrain.observe import trust
    from jtrain.observe.outputs import MODEL_SOURCE_KEY, read_run_record

    shown, workdir = workdir, os.path.abspath(workdir)
    recorded = read_run(shown)
    if model is None:  # nothing but the model's factory is imported
        trust.check(workdir, {"model": recorded.get("model") or {}}, shown=shown)
    cfg = config_lib.resolve(recorded)
    for refused, why in ((cfg.population.size > 1, "trained a population: export one "
                          "member (jtrain export RUN --member=i) to train or sample from"),
                         (cfg.finetune.lora.rank > 0, "holds LoRA adapters: merge them "
                          "into a run of its own (jtrain export --merge_lora, then "
                          "init.path)"),
                         (bool(cfg.step.factory), "trained a step of your own: its state "
                          "is not one model's params"),
                         (cfg.mesh.stage > 1, "trained with pipeline stages "
                          "(mesh.stage > 1): the decoder runs the plain layer stack"),
                         (cfg.model.quant != "none", f"trained with model.quant="
                          f"{cfg.model.quant}: the decoder runs float matmuls, not the "
                          "quantised ones it trained with")):
        if refused:
            raise UsageError("RUN", f"{shown} {why}")
    if model is None:
        source = read_run_record(workdir).get(MODEL_SOURCE_KEY)
        if source:
            raise UsageError("RUN", f"{shown} was trained with a model passed from Python "
                             f"({source.split(': ', 1)[-1]}): call jtrain.sample(RUN, "
                             "prompts, model=...)")
        if cfg.model.name not in ("transformer", "user"):
            raise UsageError("RUN", f"{shown}: model.name={cfg.model.name} is not a "
                             "language model; sampling needs the built-in transformer or "
                             f"a model with the decode interface ({INTERFACE})")
        policy = precision_lib.make_policy(cfg.model)
        model_cfg = dict(cfg.model.to_dict(), remat="none")  # remat only trades memory
        model = models_lib.make_model(model_cfg, dtype=policy.compute_dtype,
                                      param_dtype=policy.param_dtype)
    check_interface(model, "RUN" if cfg.model.name == "transformer" else "model.factory")
    try:
        step_dir = export_lib.find_step_dir(workdir, step)
    except ExportError as e:  # its line, said as the sample command's
        raise UsageError("--step" if step is not None else "RUN",
                         message(e.key, e.why)) from None
    leaves = export_lib.load_checkpoint_leaves(step_dir, ("params",))
    want = meta.unbox(jax.eval_shape(model.init, jax.random.key(0),
                                     jnp.zeros((1, 1), jnp.int32)))
    shapes = {leaf_path(p): tuple(v.shape) for p, v in
              jax.tree_util.tree_flatten_with_path({"params": want["params"]})[0]}
    if shapes != {k: tuple(v.shape) for k, v in leaves.items()}:
        raise UsageError("RUN", f"{shown}: the checkpoint's params are not those of the "
                         "model its config.json builds")
    return model, traverse_util.unflatten_dict({tuple(k.split("/")): jnp.asarray(v)
                                                for k, v in leaves.items()})
