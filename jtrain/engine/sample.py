"""`jtrain sample RUN --prompt TEXT`: text from a trained language model
(docs/guide/language-models.md: the options, the decode interface, how rows are padded
and tokens chosen).

    sample(run_or_params, prompts, *, model=None, max_new_tokens=64, temperature=0.0,
           top_k=0, top_p=1.0, seed=0, stop=(), step=None, use_cache=True,
           tokenizer=None) -> [Sample]

The run's newest intact checkpoint (or `step`) is read as `jtrain export` reads it
(integrity-checked, params only) into the model its config.json names; nothing the run
names is imported unless the run is trusted (jtrain.observe.trust). A model is sampled
through `max_len`, `init_cache(batch, length)` and `apply(variables, tokens, cache=,
pad=) -> (logits, cache)` (the built-in transformer has them); any other is refused in
one line. Prompts are left-padded to the longest and run in one call (prefill), then one
token per call into a fixed-length cache, so each of the two jitted functions compiles
once per batch; `use_cache=False` recomputes the window every token (the reference the
cache is tested against). The same seed, prompts and settings give the same tokens.

Text goes through the run's own tokenizer (the SHA-256-checked copy config.json's
data.tokenizer names, bytes for vocab_size 256, or `tokenizer=`); without one, prompts
are token ids and no text comes back. `end_of_run` is the reference run's last lines:
greedy continuations of `sample.prompts` from the final params, beside the eval loss.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jtrain.data import tokenizer as tokenizer_lib
from jtrain.errors import DataError, ExportError, UsageError, message

INTERFACE = "max_len, init_cache(batch, length), __call__(tokens, cache=, pad=)"


@dataclasses.dataclass(frozen=True)
class Sample:
    """One prompt's continuation, as `jtrain.sample` returns it.

    Attributes:
        tokens: the new token ids (a stop string cut off).
        text: the continuation decoded with the run's tokenizer, cut at a stop string;
            None without a tokenizer.
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
           stop=(), step=None, use_cache: bool = True, tokenizer=None) -> list[Sample]:
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
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = tokenizer_lib.load(os.fspath(tokenizer))
    if isinstance(run_or_params, (str, os.PathLike)):
        model, params, own = open_run(os.fspath(run_or_params), step=step, model=model)
        tokenizer = tokenizer or own
    else:
        if model is None:
            raise UsageError("model", "required with params: the module they belong to")
        check_interface(model, "model")
        params = run_or_params
    params = params if "params" in params else {"params": params}
    tokenizer = checked_tokenizer(tokenizer, model)
    rows = encode(prompts, tokenizer)
    check(rows, model, max_new_tokens, temperature, top_k, top_p)
    decoder = Decoder(model)
    return decoder.generate(params, rows, max_new_tokens=max_new_tokens, seed=seed,
                            settings=(temperature, top_k, top_p), stop=stop,
                            use_cache=use_cache, tokenizer=tokenizer)


def checked_tokenizer(tokenizer, model):
    """`tokenizer`, else bytes for a byte-level model, else None; one line when its
    vocabulary is larger than the model's."""
    vocab = getattr(model, "vocab_size", None)
    if tokenizer is None and vocab == 256:
        return tokenizer_lib.ByteTokenizer()
    if tokenizer is not None and vocab is not None and tokenizer.vocab_size > vocab:
        raise UsageError("tokenizer", f"its vocab size {tokenizer.vocab_size} is larger "
                         f"than the model's ({vocab}): not the tokenizer it trained with")
    return tokenizer


def encode(prompts, tokenizer) -> list[list[int]]:
    """Token rows of the prompts: text through the tokenizer, or ids."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not prompts:
        raise UsageError("--prompt", "required: the text to continue")
    rows = []
    for p in prompts:
        if isinstance(p, str):
            if tokenizer is None:
                raise UsageError("--prompt", "text needs the run's tokenizer, and this "
                                 "model has none: give lists of token ids (or tokenizer=)")
            p = list(tokenizer.encode(p))
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
                 use_cache=True, tokenizer=None) -> list[Sample]:
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
        stops = [s for s in ([stop] if isinstance(stop, str) else stop) if s]
        if stops and tokenizer is None:
            raise UsageError("--stop", "stop strings need the run's tokenizer, and this "
                             "model has none")
        out: list[list[int]] = [[] for _ in rows]
        texts: list[str | None] = [None] * len(rows)
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
                    if stops:
                        texts[i] = _stopped(tokenizer, rows[i], out[i], stops)
                        done[i] = "stop" if texts[i] is not None else None
            if all(done):
                break
        finish = "length" if width + max_new_tokens <= size else "context"
        return [Sample(tokens=toks, text=texts[i] if texts[i] is not None else (
            None if tokenizer is None else decoded(tokenizer, rows[i], toks)),
                       finish=("stop" if done[i] == "stop" else finish))
                for i, toks in enumerate(out)]


def decoded(tokenizer, prompt: list[int], new: list[int]) -> str:
    """The continuation's text: prompt and continuation decoded together, past the
    prompt's own text (a SentencePiece word's leading space is kept), else `new` alone."""
    head, full = tokenizer.decode(prompt), tokenizer.decode(prompt + new)
    return full[len(head):] if full.startswith(head) else tokenizer.decode(new)


def _stopped(tokenizer, prompt, tokens: list[int], stops: list[str]) -> str | None:
    """The text before the first stop string when the row's text now holds one (the
    tokens that reach into it cut from `tokens` in place), else None."""
    text = decoded(tokenizer, prompt, tokens)
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=None)
    if cut is None:
        return None
    while tokens and len(decoded(tokenizer, prompt, tokens)) > cut:
        tokens.pop()
    return text[:cut]


def built_in(cfg):
    """The built-in transformer a resolved config names, in its precision, to decode."""
    from jtrain import models as models_lib
    from jtrain import precision as precision_lib

    policy = precision_lib.make_policy(cfg.model)
    model_cfg = dict(cfg.model.to_dict(), remat="none")  # remat only trades memory
    return models_lib.make_model(model_cfg, dtype=policy.compute_dtype,
                                 param_dtype=policy.param_dtype)


def refusal(cfg) -> str | None:
    """Why a run's parameters are not one float model's to decode, or None."""
    return next((why for refused, why in (
        (cfg.population.size > 1, "trained a population: export one member (jtrain "
         "export RUN --member=i) to train or sample from"),
        (cfg.finetune.lora.rank > 0, "holds LoRA adapters: merge them into a run of its "
         "own (jtrain export --merge_lora, then init.path)"),
        (bool(cfg.step.factory), "trained a step of your own: its state is not one "
         "model's params"),
        (cfg.mesh.stage > 1, "trained with pipeline stages (mesh.stage > 1): the decoder "
         "runs the plain layer stack"),
        (cfg.model.quant != "none", f"trained with model.quant={cfg.model.quant}: the "
         "decoder runs float matmuls, not the quantised ones it trained with"))
                 if refused), None)


def run_tokenizer(workdir: str, cfg, shown: str):
    """The run's copy of its tokenizer (data.tokenizer names it and its SHA-256), or
    None (bytes, or no tokenizer recorded)."""
    named = cfg.data.tokenizer
    if not named or named == tokenizer_lib.BYTE:
        return None
    file, _, digest = named.partition(" (sha256 ")
    path = os.path.join(workdir, os.path.basename(file))
    if not os.path.isfile(path) or tokenizer_lib.file_sha256(path) != digest.rstrip(")"):
        raise UsageError("RUN", f"{shown}: {os.path.basename(file)} is missing or changed: "
                         f"not the tokenizer config.json names ({named})")
    return tokenizer_lib.load(path)


def end_of_run(cfg, run, state) -> list[str]:
    """The lines that end a run with `sample.prompts`: each prompt's greedy continuation
    (sample.max_new_tokens, at most the context) from the final params, or one line
    saying why this run has none. Nothing of the state changes."""
    prompts, new = list(cfg.sample.prompts), int(cfg.sample.max_new_tokens)
    if not prompts or new <= 0:
        return []
    why = refusal(cfg) or (None if run.build.model_name == "transformer" else
                           f"model {run.build.model_name} is not the built-in transformer")
    why = why or (jax.process_count() > 1 and "a run of several processes")
    if why:
        return [f"jtrain: sample: off: {why}"]
    path = run.data.info.get("tokenizer_path")
    try:
        out = sample({"params": jax.device_get(state.params)}, prompts, model=built_in(cfg),
                     tokenizer=path and tokenizer_lib.load(path), max_new_tokens=new)
    except (UsageError, DataError) as e:  # a finished run is not failed by its sample
        return [f"jtrain: sample: off: {message(e.key, e.why)}"]
    return [f"jtrain: sample: {p!r} -> {s.text!r}" for p, s in zip(prompts, out, strict=True)]


def open_run(workdir: str, *, step=None, model=None) -> tuple[Any, dict, Any]:
    """(model, {"params": ...}, the run's tokenizer or None) of a run's checkpoint; one
    line for a run that cannot be sampled (not a run, a population, LoRA adapters, a
    step of your own, a model without the decode interface or passed from Python, a
    damaged checkpoint)."""
    from flax import traverse_util
    from flax.core import meta

    from jtrain import config as config_lib
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
    why = refusal(cfg)
    if why:
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
        model = built_in(cfg)
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
                                                for k, v in leaves.items()}), \
        run_tokenizer(workdir, cfg, shown)
