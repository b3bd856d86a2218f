"""The instruction-tuning example (examples/instruct, configs/recipes/sft.py and dpo.py;
docs/guide/language-models.md) as its user meets it: the data written by the example's
script, SFT from the command line, then greedy samples that answer after the assistant
header and stop at the end tag, where the same model untrained does not; DPO from the
SFT run, SIGKILLed and restarted by jtrain's resume verifier (bitwise identical to the
run straight through), its reference still the SFT parameters and the
chosen-minus-rejected log-probability margin on the held-out pairs above the SFT
model's."""

import contextlib
import json
import runpy
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import linen as nn

import jtrain
from jtrain import errors
from jtrain.checkpoint.export import load_checkpoint_leaves
from jtrain.data import chat
from jtrain.recipes import dpo

from journey import killed_and_restarted, run_python

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
END = "<|end|>"


def _tree(leaves: dict, prefix: str) -> dict:
    out: dict = {}
    for key, value in leaves.items():
        if key.startswith(prefix):
            *path, name = key[len(prefix):].split("/")
            node = out
            for p in path:
                node = node.setdefault(p, {})
            node[name] = value
    return out


@pytest.fixture(scope="module")
def cwd(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("instruct")
    for src in ("examples/instruct/make_data.py", "configs/recipes/sft.py",
                "configs/recipes/dpo.py"):
        shutil.copy(ROOT / src, cwd)  # as a user copies them
    proc = run_python(cwd, "make_data.py")
    assert proc.returncode == 0, proc.stderr
    proc = run_python(cwd, "-m", "jtrain.main", "--config=sft.py:debug",
                      "--workdir=runs/sft")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd


def test_sft_samples_follow_the_template_where_the_untrained_model_does_not(cwd):
    qa = runpy.run_path(str(cwd / "make_data.py"))["QA"]
    prompts = [chat.render([{"role": "user", "content": q}], prompt=True) for q, _ in qa]
    after = jtrain.sample(str(cwd / "runs/sft"), prompts, max_new_tokens=16, stop=[END])
    assert [(s.text, s.finish) for s in after] == [(a, "stop") for _, a in qa]

    config = json.loads((cwd / "runs/sft/config.json").read_text())
    model = jtrain.make_model(config["model"], dtype="float32", param_dtype="float32")
    fresh = nn.unbox(model.init(jax.random.key(0), np.zeros((1, 8), np.int32))["params"])
    before = jtrain.sample(fresh, prompts, model=model, max_new_tokens=16, stop=[END])
    assert not any(s.finish == "stop" or s.text == a
                   for s, (_, a) in zip(before, qa, strict=True)), before


def test_dpo_resumes_bitwise_and_raises_the_held_out_margin(cwd):
    config = runpy.run_path(str(cwd / "dpo.py"))["get_config"]("debug")
    run = killed_and_restarted(cwd, config, ["-m", "jtrain.main", "--config=dpo.py:debug"],
                               "runs/dpo")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step"] == 40 and summary["skipped_steps"] == 0

    leaves = load_checkpoint_leaves(str(run / "checkpoints" / "40"))
    sft = _tree(load_checkpoint_leaves(str(cwd / "runs/sft/checkpoints/200")), "params/")
    policy, ref = _tree(leaves, "params/policy/"), _tree(leaves, "params/ref/")
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(sft), strict=True):
        np.testing.assert_array_equal(a, b)  # the reference stays the SFT model
    net = dpo.make_model(config.step.kwargs["model"])
    held_out = dpo.encode_pairs(str(cwd / "pairs_eval.jsonl"), 64)

    def margins(params):
        logps = np.asarray(dpo.answer_logps(net, params, held_out))
        return logps[:, 0] - logps[:, 1]

    before, after = margins(sft), margins(policy)
    assert (after > before).all(), (before, after)
    qa = runpy.run_path(str(cwd / "make_data.py"))["QA"]  # the tuned policy still answers
    prompts = [chat.render([{"role": "user", "content": q}], prompt=True) for q, _ in qa]
    out = jtrain.sample(policy, prompts, model=net, max_new_tokens=16, stop=[END])
    assert [(s.text, s.finish) for s in out] == [(a, "stop") for _, a in qa]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/loss"] for r in records if "eval/loss" in r]
    assert evals[-1] < 0.9 * np.log(2), evals  # the DPO loss at the start is log 2
    assert "initialized policy,ref from runs/sft" in (run / "train.log").read_text()

    config.init.into = "policy,opt"  # sub-trees of two structures: one line
    with contextlib.chdir(cwd), pytest.raises(errors.JtrainError) as e:
        jtrain.train(config, "runs/bad")
    assert errors.render(e.value) == (
        "jtrain: config error: init.into: policy, opt: sub-trees of different structures; "
        "one source fills sub-trees of one structure")
