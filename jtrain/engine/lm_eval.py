"""jtrain's language models in EleutherAI's lm-evaluation-harness (the `lmeval` extra).

    import jtrain.engine.lm_eval                      # registers the model type "jtrain"
    lm_eval.simple_evaluate(model="jtrain", model_args="run=runs/lm", tasks=[...])

`JtrainLM(run, step=None, batch_size=16)` reads a run's parameters as `jtrain sample`
does (integrity-checked, none of its code run unless trusted; the same runs refused) and
its tokenizer (the workdir's copy config.json names, else bytes for a vocabulary of
256). loglikelihood and loglikelihood_rolling score exactly as
eval.lm_tasks does in training (jtrain/engine/lm_tasks.py: the same tokenization, rows of
data.seq_len + 1 tokens, the same windows); generate_until decodes greedily (or at the
request's temperature) with the KV-cache sampler, stopping at the first of the
request's `until` strings (cut).
"""

from __future__ import annotations

import jax
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from jtrain import config as config_lib
from jtrain.engine import lm_tasks
from jtrain.engine import sample as sample_lib
from jtrain.engine.replay import read_run
from jtrain.errors import UsageError


@register_model("jtrain")
class JtrainLM(LM):
    """A jtrain run as an lm-eval model (module docstring)."""

    def __init__(self, run: str | None = None, step=None, batch_size=16, pretrained=None,
                 **_ignored):  # lm-eval passes device, max_batch_size, ...: one device here
        super().__init__()
        run = run or pretrained
        if not run:
            raise UsageError("model_args", "run=RUN: the run directory to evaluate")
        self.model, self.params, own = sample_lib.open_run(str(run), step=step)
        self.seq_len = int(config_lib.resolve(read_run(str(run))).data.seq_len)
        self.tokenizer = sample_lib.checked_tokenizer(own, self.model)
        if self.tokenizer is None:
            raise UsageError("RUN", f"{run}: the run has no tokenizer (not trained on "
                             "token shards, and its vocabulary is not the 256 bytes)")
        self.batch = int(batch_size) if str(batch_size).isdigit() else 16
        self._fn = jax.jit(lm_tasks.token_logprobs(
            lambda p, x, rng=None, train=False: self.model.apply(p, x)))
        self._decoder = sample_lib.Decoder(self.model)

    def _score(self, pieces):
        return lm_tasks.score_rows(self._fn, self.params,
                                   lm_tasks.make_rows(pieces, self.seq_len), self.batch)

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pieces = lm_tasks.choice_pieces([tuple(r.args) for r in requests],
                                        self.tokenizer.encode, self.tokenizer.eos,
                                        self.seq_len)
        sums, greedy = self._score(pieces)
        return [(float(s), bool(g)) for s, g in zip(sums, greedy, strict=True)]

    def loglikelihood_rolling(self, requests) -> list[float]:
        out = []
        for r in requests:
            pieces = lm_tasks.rolling_pieces(self.tokenizer.encode(r.args[0]),
                                             self.tokenizer.eos, self.seq_len)
            out.append(float(self._score(pieces)[0].sum()) if pieces else 0.0)
        return out

    def generate_until(self, requests) -> list[str]:
        out = []
        for r in requests:
            context, kwargs = r.args[0], dict(r.args[1] if len(r.args) > 1 else {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            new = max(1, min(int(kwargs.get("max_gen_toks", 256)), self.model.max_len - 1))
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get(
                "do_sample", True) else 0.0
            ids = [int(t) for t in self.tokenizer.encode(context)][-(self.model.max_len - new):]
            got = self._decoder.generate(self.params, [ids or [self.tokenizer.eos or 0]],
                                         max_new_tokens=new, seed=0, stop=until,
                                         settings=(temperature, 0, 1.0),
                                         tokenizer=self.tokenizer)[0]
            out.append(got.text)
        return out
