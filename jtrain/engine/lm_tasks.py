"""eval.lm_tasks: a language model scored on local files at every evaluation, as eval
metrics (early stopping, the plateau and best-k may watch them); the same scoring serves
the lm-eval adapter (jtrain/engine/lm_eval.py).

    eval.lm_tasks = {NAME: {"kind": "choice" | "perplexity", "path": FILE}}

choice: a JSONL file, one example a line, {"context": str, "choices": [str, ...],
"label": int}. Each choice is scored as the continuation of the context: the sum of its
tokens' log-probabilities. eval/NAME/acc is the fraction of examples whose likeliest
choice is the label; eval/NAME/acc_norm the same with each sum divided by the choice's
length in characters (lm-eval's acc_norm). The pair is tokenized as lm-eval does: the
context alone, and context + choice whole, the choice's tokens being what follows the
context's (a trailing space of the context moves to the choice). A row is the context's
tokens then the choice's, cut from the left to data.seq_len + 1 tokens.

perplexity: a text file tokenized whole, after the tokenizer's separator when it has
one (so the first token is predicted too). Its tokens are cut into windows of
data.seq_len + 1 tokens, each overlapping the next by one token: window k predicts
tokens k*L+1 ... (k+1)*L (L = data.seq_len) from the tokens before them in the window,
so every token is predicted once, with 1 to L tokens of context. eval/NAME/ppl =
exp(the tokens' summed negative log-likelihood / their count).

Rows are right-padded (the model is causal: padding after a token does not change it),
scored in batches sharded on the batch axis, and summed on the host in float64, so the
result does not depend on the batch size or the device count.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jtrain.errors import ConfigError, DataError, first_line

KINDS = {"choice": ("acc", "acc_norm"), "perplexity": ("ppl",)}


def tasks_of(cfg) -> dict[str, dict]:
    """eval.lm_tasks checked: {name: {"kind", "path"}}; a ConfigError naming the key."""
    given = cfg.eval.lm_tasks
    tasks = given.to_dict() if hasattr(given, "to_dict") else dict(given)
    for name, task in tasks.items():
        key = f"eval.lm_tasks.{name}"
        if not name or "/" in name or not isinstance(task, dict):
            raise ConfigError(key, "each task is NAME: {kind, path} (a name without '/')")
        if task.get("kind") not in KINDS or not isinstance(task.get("path"), str) \
                or set(task) - {"kind", "path"}:
            raise ConfigError(key, f"must be {{kind: {' | '.join(KINDS)}, path: FILE}}, "
                              f"got {task!r}")
    return tasks


def metric_names(cfg, prefixes=("eval/",)) -> set[str]:
    """The metrics eval.lm_tasks adds, known from the config alone."""
    return {f"{p}{name}/{m}" for name, t in tasks_of(cfg).items() for m in KINDS[t["kind"]]
            for p in prefixes}


@dataclasses.dataclass
class Rows:
    """Token rows to score: tokens [N, L + 1] (inputs = [:, :-1], targets = [:, 1:]), the
    target positions that count [N, L]."""
    tokens: np.ndarray
    mask: np.ndarray


def make_rows(pieces: list[tuple[list[int], int]], seq_len: int) -> Rows:
    """Rows of (token ids, how many of the last ids are scored): cut from the left to
    seq_len + 1 tokens, right-padded with 0."""
    tokens = np.zeros((len(pieces), seq_len + 1), np.int32)
    mask = np.zeros((len(pieces), seq_len), np.float32)
    for i, (ids, scored) in enumerate(pieces):
        ids = ids[-(seq_len + 1):]
        tokens[i, :len(ids)] = ids
        mask[i, len(ids) - 1 - scored:len(ids) - 1] = 1.0
    return Rows(tokens, mask)


def pair_ids(encode, context: str, continuation: str, eos) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval's Hugging Face model makes them; an
    empty context is the separator (none: a DataError)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if not context:
        if eos is None:
            raise DataError("context", "empty, and the tokenizer has no separator to "
                            "start from")
        return [int(eos)], [int(t) for t in encode(continuation)]
    ctx, whole = [int(t) for t in encode(context)], [int(t) for t in encode(context + continuation)]
    return ctx, whole[len(ctx):]


def choice_pieces(pairs, encode, eos, seq_len: int, where: str = "continuation"):
    """(ids, scored) per (context, continuation) pair; a continuation of more than
    seq_len tokens (no context left to predict it from) is a DataError at `where`."""
    out = []
    for i, (context, continuation) in enumerate(pairs):
        ctx, cont = pair_ids(encode, context, continuation, eos)
        if not cont or len(cont) > seq_len:
            raise DataError(where if len(pairs) == 1 else f"{where}[{i}]",
                            f"{len(cont)} tokens: a continuation must have 1 to "
                            f"data.seq_len = {seq_len}")
        out.append((ctx + cont, len(cont)))
    return out


def rolling_pieces(ids, eos, seq_len: int) -> list[tuple[list[int], int]]:
    """The perplexity windows of one text's ids (module docstring)."""
    seq = ([int(eos)] if eos is not None else []) + [int(t) for t in ids]
    return [(seq[s:s + seq_len + 1], len(seq[s:s + seq_len + 1]) - 1)
            for s in range(0, max(len(seq) - 1, 0), seq_len)]


def token_logprobs(apply):
    """fn(params, inputs [B, L], targets [B, L]) -> (log p(target) [B, L] float32,
    target is the argmax [B, L]) over `apply(params, inputs, rng=, train=)` (jtrain's
    ModelFns.apply: logits, or a dict with "logits")."""
    def fn(params, inputs, targets):
        out = apply(params, inputs, rng=None, train=False)
        logits = (out["logits"] if isinstance(out, dict) else out).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return (jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0],
                jnp.argmax(logits, axis=-1) == targets)
    return fn


def score_rows(fn, params, rows: Rows, batch: int, put=None, gather=None):
    """(sum of the scored log-probabilities [N] float64, every scored target was the
    argmax [N]) of `rows`, `batch` rows a call; `put` places a global batch (default:
    as it is), `gather` brings a result to the host (default: device_get)."""
    n = len(rows.tokens)
    padded = np.zeros((-(-n // batch) * batch, rows.tokens.shape[1]), np.int32)
    padded[:n] = rows.tokens
    put = put or (lambda x: x)
    gather = gather or (lambda x: np.asarray(jax.device_get(x)))
    logp, hits = [], []
    for i in range(0, len(padded), batch):
        chunk = padded[i:i + batch]
        lp, hit = fn(params, put(chunk[:, :-1]), put(chunk[:, 1:]))
        logp.append(gather(lp))
        hits.append(gather(hit))
    logp = np.concatenate(logp)[:n].astype(np.float64)
    hit = np.concatenate(hits)[:n]
    scored = rows.mask > 0
    return (np.where(scored, logp, 0.0).sum(axis=1),
            np.where(scored, hit, True).all(axis=1))


@dataclasses.dataclass
class Task:
    name: str
    kind: str
    rows: Rows
    example: np.ndarray  # choice: the example of each row [N]
    labels: np.ndarray   # choice: each example's label [E]
    chars: np.ndarray    # choice: each row's continuation length in characters [N]

    def metrics(self, sums: np.ndarray) -> dict[str, float]:
        if self.kind == "perplexity":
            return {"ppl": math.exp(-sums.sum() / self.rows.mask.sum())}
        acc = norm = 0
        for e, label in enumerate(self.labels):
            lls = sums[self.example == e]
            acc += int(np.argmax(lls)) == label
            norm += int(np.argmax(lls / self.chars[self.example == e])) == label
        return {"acc": float(acc / len(self.labels)), "acc_norm": float(norm / len(self.labels))}


def read_choices(path: str) -> list[dict]:
    """The examples of a choice file; a DataError naming the file and line."""
    from jtrain.data.tokens import jsonl_records

    out = []
    for where, ex in jsonl_records(path):
        ok = (isinstance(ex, dict) and isinstance(ex.get("context"), str)
              and isinstance(ex.get("choices"), list) and len(ex["choices"]) >= 2
              and all(isinstance(c, str) and c for c in ex["choices"])
              and type(ex.get("label")) is int and 0 <= ex["label"] < len(ex["choices"]))
        if not ok:
            raise DataError(where, 'want {"context": str, "choices": [2 or more non-empty '
                            'str], "label": index of the answer}')
        out.append(ex)
    if not out:
        raise DataError(path, "no examples")
    return out


def load_task(name: str, kind: str, path: str, tokenizer, seq_len: int) -> Task:
    """One task's file read, tokenized and cut into rows; a DataError naming the file
    (and line) for a file that is missing or malformed."""
    try:
        if kind == "perplexity":
            with open(path, encoding="utf-8") as f:
                text = f.read()
            pieces = rolling_pieces(tokenizer.encode(text), tokenizer.eos, seq_len)
            if not pieces:
                raise DataError(path, "no tokens to predict")
            empty = np.zeros(0, np.int64)
            return Task(name, kind, make_rows(pieces, seq_len), empty, empty, empty)
        examples = read_choices(path)
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(path, f"cannot be read as UTF-8 text: {e}") from None
    pieces, example, chars = [], [], []
    for number, ex in enumerate(examples, 1):
        try:
            pieces += choice_pieces([(ex["context"], c) for c in ex["choices"]],
                                    tokenizer.encode, tokenizer.eos, seq_len, "choices")
        except DataError as e:
            raise DataError(f"{path}:{number}", f"{e.key}: {e.why}") from None
        example += [number - 1] * len(ex["choices"])
        chars += [len(c) for c in ex["choices"]]
    return Task(name, kind, make_rows(pieces, seq_len), np.asarray(example),
                np.asarray([ex["label"] for ex in examples]), np.asarray(chars, np.float64))


def check_model(apply, abstract_params, seq_len: int, vocab: int) -> None:
    """A ConfigError unless the model maps tokens [B, seq_len] to logits [B, seq_len, V]
    with V >= the tokenizer's vocabulary (a model of your own may not)."""
    want = f"tokens [batch, {seq_len}] -> logits [batch, {seq_len}, vocab >= {vocab}]"
    try:
        out = jax.eval_shape(lambda p, x: apply(p, x, rng=None, train=False),
                             abstract_params, jax.ShapeDtypeStruct((2, seq_len), jnp.int32))
    except Exception as e:  # the model's own error, said in one line
        raise ConfigError("eval.lm_tasks", f"the model must map {want}; calling it "
                          f"failed: {first_line(e)}") from None
    shape = getattr(out["logits"] if isinstance(out, dict) else out, "shape", None)
    if shape is None or len(shape) != 3 or shape[:2] != (2, seq_len) or shape[2] < vocab:
        raise ConfigError("eval.lm_tasks", f"the model must map {want}, got {shape}")


class Scorer:
    """A run's tasks, scored with its model at each eval (one compilation: every batch
    has data.seq_len tokens and the eval batch's rows)."""

    def __init__(self, tasks: list[Task], apply, mesh, batch: int):
        from jax.experimental import multihost_utils

        from jtrain import mesh as mesh_lib

        self.tasks, self.batch = tasks, batch
        self.fn = jax.jit(token_logprobs(apply))
        local, p = batch // jax.process_count(), jax.process_index()
        self.put = lambda x: mesh_lib.host_to_device(x[p * local:(p + 1) * local], mesh)
        self.gather = (None if jax.process_count() == 1 else lambda x: np.asarray(
            multihost_utils.process_allgather(x, tiled=True)))

    def __call__(self, params, prefix: str = "eval/") -> dict[str, float]:
        out = {}
        for task in self.tasks:
            sums, _ = score_rows(self.fn, params, task.rows, self.batch, self.put, self.gather)
            out.update({f"{prefix}{task.name}/{k}": v for k, v in task.metrics(sums).items()})
        return out


def for_run(cfg, b, data) -> Scorer | None:
    """The Scorer of eval.lm_tasks for a run (`b` its Build, `data` its RunData); None
    without tasks; one line for what it cannot score."""
    from jtrain.data import tokenizer as tokenizer_lib

    tasks = tasks_of(cfg)
    if not tasks:
        return None
    for refused, why in ((cfg.population.size > 1, "a population's members are scored "
                          "apart by the eval; score an exported member instead"),
                         (b.user_step is not None, "a step of your own calls its model "
                          "itself"),
                         (cfg.eval.mode == "async", "the async evaluator scores the eval "
                          "set only; use eval.mode=sync"),
                         (len(cfg.data.model_inputs) > 1, "the model takes several inputs "
                          f"({', '.join(cfg.data.model_inputs)}), the tasks give it tokens")):
        if refused:
            raise ConfigError("eval.lm_tasks", why)
    path = data.info.get("tokenizer_path")
    if path is None and not data.byte_level:
        raise ConfigError("eval.lm_tasks", "needs the run's tokenizer: train on token "
                          "shards (data.name=tokens) or the byte-level corpus")
    tok = tokenizer_lib.load(path or tokenizer_lib.BYTE)
    check_model(b.model_fns.apply, b.abstract.params, cfg.data.seq_len, tok.vocab_size)
    loaded = [load_task(name, t["kind"], t["path"], tok, cfg.data.seq_len)
              for name, t in tasks.items()]
    return Scorer(loaded, b.model_fns.apply, b.mesh, data.eval_batch * jax.process_count())
