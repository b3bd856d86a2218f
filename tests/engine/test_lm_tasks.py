"""eval.lm_tasks (jtrain/engine/lm_tasks.py) and the lm-eval adapter (jtrain/engine/lm_eval.py):
a tiny byte-level transformer trained 2 steps with a choice task and a perplexity task;
its eval/<task>/acc, acc_norm and ppl equal a numpy computation over the logits of a
plain apply of the final parameters, one example at a time, unpadded; the same on 8 fake
devices (batch sharded); lm-eval's simple_evaluate on a local YAML + JSONL task gives the
same accuracies, and the adapter's loglikelihoods and rolling loglikelihood equal the
hand computation. The windows and rows are checked on their own; a bad file is one line
naming file and line."""

import collections
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jtrain
from jtrain import errors
from jtrain.engine import lm_tasks

CHOICES = [
    {"context": "def f(x):\n    return", "choices": [" x", " 1 + 2", "zzz"], "label": 0},
    {"context": "import ", "choices": ["os", "qqqq"], "label": 1},
    {"context": "class A:\n    ", "choices": ["pass", "def f(s):", "$"], "label": 2},
]
TEXT = 'import os\nimport sys\n\n\ndef main():\n    print("hello world")\n    return 0\n'
SEQ = 16


def config(tmp, **extra):
    return {"model": {"d_model": 16, "num_layers": 1, "num_heads": 2, "d_ff": 32,
                      "max_len": SEQ, "dtype": "float32"},
            "data": {"seq_len": SEQ, "batch_size": 8}, "total_steps": 2,
            "eval": {"every_steps": 2, "num_batches": 1, "batch_size": 8, "lm_tasks": {
                "ch": {"kind": "choice", "path": os.path.join(tmp, "choice.jsonl")},
                "held": {"kind": "perplexity", "path": os.path.join(tmp, "held.txt")}}},
            "early_stop": {"monitor": "eval/ch/acc_norm", "mode": "max", "patience": 5},
            **extra}


def write_files(tmp):
    with open(os.path.join(tmp, "choice.jsonl"), "w") as f:
        f.write("".join(json.dumps(ex) + "\n" for ex in CHOICES))
    with open(os.path.join(tmp, "held.txt"), "w") as f:
        f.write(TEXT)


def train(tmp):
    write_files(tmp)
    result = jtrain.train(config(tmp), os.path.join(tmp, "run"))
    params = result.state.params
    return result.history[-1], params if "params" in params else {"params": params}


def hand(params):
    """The numbers by hand: every sequence alone (its last SEQ + 1 bytes) through
    model.apply, numpy log-softmax in float64."""
    model = jtrain.make_model(config("")["model"] | {"name": "transformer",
                                                     "vocab_size": 256, "dropout": 0.0},
                              dtype="float32", param_dtype="float32")

    def logp(ids):  # log p(ids[i + 1] | ids[:i + 1]) for every i
        logits = np.asarray(model.apply(params, jnp.asarray([ids[:-1]])), np.float64)[0]
        logits = logits - logits.max(-1, keepdims=True)
        lsm = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        return lsm[np.arange(len(ids) - 1), ids[1:]]

    def scored(ex, c):  # the choice and the context's trailing whitespace (lm-eval's)
        return len(c) + len(ex["context"]) - len(ex["context"].rstrip())

    lls = [[logp(list((ex["context"] + c).encode())[-(SEQ + 1):])[-scored(ex, c):].sum()
            for c in ex["choices"]] for ex in CHOICES]
    acc = np.mean([np.argmax(ll) == ex["label"] for ll, ex in zip(lls, CHOICES, strict=True)])
    norm = np.mean([np.argmax(np.asarray(ll) / [len(c) for c in ex["choices"]]) == ex["label"]
                    for ll, ex in zip(lls, CHOICES, strict=True)])
    ids = list(TEXT.encode())  # windows of SEQ + 1 bytes overlapping by one
    total = sum(logp(ids[s:s + SEQ + 1]).sum() for s in range(0, len(ids) - 1, SEQ))
    return {"lls": lls, "acc": acc, "acc_norm": norm, "total": total,
            "ppl": math.exp(-total / (len(ids) - 1))}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("lm"))
    last, params = train(tmp)
    return tmp, last, params, hand(params)


@pytest.mark.slow
def test_metrics_equal_the_hand_computation(run):
    _, last, _, want = run
    assert last["eval/ch/acc"] == want["acc"] and last["eval/ch/acc_norm"] == want["acc_norm"]
    assert last["eval/held/ppl"] == pytest.approx(want["ppl"], rel=1e-5)
    assert 0 < want["acc"] < 1 or want["acc_norm"] != want["acc"]  # not all one answer


@pytest.mark.multidevice
def test_eight_devices_give_the_hand_computation(tmp_path):
    """The run's Scorer on a mesh of 8 devices (rows sharded 1 per device): the numbers
    of the unsharded numpy computation."""
    assert jax.device_count() == 8
    cfg, b, params, data = _built(str(tmp_path))
    assert b.mesh.shape["data"] == 8
    scorer = lm_tasks.for_run(cfg, b, data._replace(eval_batch=8))
    with jax.set_mesh(b.mesh):
        got = scorer(params)
    want = hand(params if "params" in params else {"params": params})
    assert got["eval/ch/acc"] == want["acc"] and got["eval/ch/acc_norm"] == want["acc_norm"]
    assert got["eval/held/ppl"] == pytest.approx(want["ppl"], rel=1e-5)


@pytest.mark.slow
def test_lm_eval_scores_the_run_as_the_metric_does(run, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import socket

    def no_network(*args, **kwargs):
        raise AssertionError(f"lm-eval reached for the network: {args}")
    monkeypatch.setattr(socket.socket, "connect", no_network)
    from lm_eval.api.instance import Instance

    from jtrain.engine.lm_eval import JtrainLM

    tmp, last, _, want = run
    # the guide's example (docs/guide/language-models.md): a task of a local YAML and
    # JSONL through simple_evaluate, run where the run and the file are
    guide = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "guide",
                              "language-models.md")).read()
    example = next(b for b in guide.split("```python\n") if "simple_evaluate(model=Jtrain" in b)
    monkeypatch.chdir(tmp)
    scope: dict = {}
    exec(example.split("```")[0], scope)
    got = scope["out"]["results"]["tiny_choice"]
    assert (got["acc,none"], got["acc_norm,none"]) == (last["eval/ch/acc"],
                                                        last["eval/ch/acc_norm"])
    lm = JtrainLM(run=os.path.join(tmp, "run"), batch_size=4)
    reqs = [Instance("loglikelihood", {}, (ex["context"], c), 0)
            for ex in CHOICES for c in ex["choices"]]
    lls = [ll for ll, _ in lm.loglikelihood(reqs)]
    np.testing.assert_allclose(lls, [x for row in want["lls"] for x in row], rtol=1e-5)
    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (TEXT,), 0)])
    assert rolling[0] == pytest.approx(want["total"], rel=1e-5)
    text = lm.generate_until([Instance("generate_until", {},
                                       ("def ", {"until": ["\n"], "max_gen_toks": 6}), 0)])
    greedy = jtrain.sample(os.path.join(tmp, "run"), "def ", max_new_tokens=6)[0].text
    assert text == [greedy.split("\n")[0]]


def test_windows_predict_every_token_once():
    ids = list(range(1, 38))
    pieces = lm_tasks.rolling_pieces(ids, None, 8)
    assert [p[0][0] for p in pieces] == [1, 9, 17, 25, 33]  # overlapping by one token
    assert sum(n for _, n in pieces) == len(ids) - 1
    rows = lm_tasks.make_rows(pieces, 8)
    assert rows.mask.sum() == len(ids) - 1 and rows.mask[-1].tolist() == [1] * 4 + [0] * 4
    with_eos = lm_tasks.rolling_pieces(ids, 0, 8)  # a separator first: every token scored
    assert sum(n for _, n in with_eos) == len(ids)


def test_a_long_context_is_cut_from_the_left():
    rows = lm_tasks.make_rows([(list(range(1, 21)), 3)], 8)
    assert rows.tokens[0].tolist() == list(range(12, 21))
    assert rows.mask[0].tolist() == [0] * 5 + [1] * 3
    with pytest.raises(errors.DataError, match="continuation"):
        lm_tasks.choice_pieces([("a", "x" * 9)], lambda s: list(s.encode()), None, 8)


@pytest.mark.parametrize("line,why", [
    ("not json", "not JSON"),
    ('{"context": "a", "choices": ["b"], "label": 0}', "2 or more"),
    ('{"context": "a", "choices": ["b", "c"], "label": 2}', "index of the answer"),
])
def test_a_bad_line_is_named(tmp_path, line, why):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(CHOICES[0]) + "\n" + line + "\n")
    with pytest.raises(errors.DataError) as e:
        lm_tasks.read_choices(str(path))
    assert e.value.key == f"{path}:2" and why in e.value.why


def _built(tmp, **extra):
    """(cfg, Build, params) of the tiny model with eval.lm_tasks, freshly initialised."""
    write_files(tmp)
    cfg = jtrain.resolve(config(tmp, **extra))
    tokens = np.zeros(SEQ, np.int32)
    b = jtrain.build(cfg, sample=tokens, eval_example={"inputs": tokens, "targets": tokens},
                     byte_level=True)
    from jtrain import state as state_lib
    params = state_lib.eval_params(b.init(), "params")
    data = collections.namedtuple("RunData", "info byte_level eval_batch")({}, True, 4)
    return cfg, b, params, data


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    {"model": {"moe": {"experts": 2, "k": 1, "capacity_factor": 2.0}}},
    {"model": {"quant": "int8"}},
    {"finetune": {"lora": {"rank": 2}}},
], ids=["moe", "int8", "lora"])
def test_the_run_s_model_function_is_scored(tmp_path, extra):
    """MoE (a dict of outputs), int8 matmuls and LoRA adapters: the tasks score what the
    run's model function returns, as a numpy computation over the same function, one
    window at a time, does."""
    base = config(str(tmp_path))
    extra = {k: base.get(k, {}) | v if k == "model" else v for k, v in extra.items()}
    cfg, b, params, data = _built(str(tmp_path), **extra)
    got = lm_tasks.for_run(cfg, b, data)(params)

    apply = jax.jit(lambda p, x: b.model_fns.apply(p, x, rng=None, train=False))

    def logp(ids):  # each window alone, unpadded (qwix's interception runs under jit)
        out = apply(params, jnp.asarray([ids[:-1]]))
        logits = np.asarray(out["logits"] if isinstance(out, dict) else out, np.float64)[0]
        lsm = logits - logits.max(-1, keepdims=True)
        lsm = lsm - np.log(np.exp(lsm).sum(-1, keepdims=True))
        return lsm[np.arange(len(ids) - 1), ids[1:]]

    ids = list(TEXT.encode())
    total = sum(logp(ids[s:s + SEQ + 1]).sum() for s in range(0, len(ids) - 1, SEQ))
    # int8 quantises activations with one scale per tensor: the batch's padding moves
    # the scale, so the score is close, not exact (documented; 4e-4 here)
    rel = 2e-3 if "quant" in extra.get("model", {}) else 1e-5
    assert got["eval/held/ppl"] == pytest.approx(math.exp(-total / (len(ids) - 1)), rel=rel)
    assert set(got) == {"eval/ch/acc", "eval/ch/acc_norm", "eval/held/ppl"}


@pytest.mark.parametrize("extra,why", [
    ({"population": {"size": 2}, "early_stop": {"monitor": ""}}, "population"),
    ({"eval": {"mode": "async"}}, "async evaluator"),
])
def test_what_cannot_be_scored_is_refused_in_one_line(tmp_path, extra, why):
    import types

    cfg = config(str(tmp_path))
    cfg = jtrain.resolve({**cfg, **{k: cfg.get(k, {}) | v for k, v in extra.items()}})
    b = types.SimpleNamespace(user_step=None)
    with pytest.raises(errors.ConfigError) as e:
        lm_tasks.for_run(cfg, b, None)
    assert e.value.key == "eval.lm_tasks" and why in e.value.why
    with pytest.raises(errors.ConfigError, match="kind"):
        lm_tasks.tasks_of(jtrain.resolve(config(str(tmp_path)) | {"eval": {
            "lm_tasks": {"x": {"kind": "mmlu", "path": "a"}}}}))


@pytest.mark.parametrize("outputs,why", [
    (lambda x: jnp.zeros((x.shape[0], 3)), "got (2, 3)"),  # a classifier of your own
    (lambda x: jnp.zeros((x.shape[0], x.shape[1], 100)), "got (2, 16, 100)"),  # vocab < 256
    (lambda x: x @ jnp.zeros((3, 3)), "calling it failed"),
])
def test_a_model_that_is_not_a_language_model_is_refused(outputs, why):
    """A model of your own is scored when it maps tokens to logits over the vocabulary;
    any other is one line before step 1."""
    with pytest.raises(errors.ConfigError) as e:
        lm_tasks.check_model(lambda p, x, rng, train: outputs(x), {}, SEQ, 256)
    assert e.value.key == "eval.lm_tasks" and why in e.value.why
