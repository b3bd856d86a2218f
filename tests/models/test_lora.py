"""LoRA fine-tuning through qwix (`finetune.lora.*`, jtrain/models/lora.py): only the
adapters train (base weights bitwise unchanged, optimizer state for adapters only) for a
Linen and an NNX model; the merged weights (`W + alpha/rank * A @ B`) make the plain model
compute what the adapted one does (Linen, NNX, the built-in transformer, multi-axis and
einsum kernels), and every adapter gets a gradient; `init.path` of a plain run
keeps the adapters fresh; bad settings are one-line config errors; a user's journey: a
script pretrains and LoRA fine-tunes their model, the CLI exports it with --merge_lora
(the CLI's one lines for a run without LoRA and a config that adapts nothing, in-process)."""

import json
import sys

import jax
import numpy as np
import optax
import pytest
from flax import linen as nn, nnx

import jtrain
import jtrain.export
from jtrain import main as main_lib
from jtrain.checkpoint import export as export_lib
from jtrain.errors import ConfigError, RestoreError, UsageError
from jtrain.models import lora
from journey import run_python, user_dir
from projects.mymodels import Net as Net3

pytest.importorskip("qwix")


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        h = nn.relu(nn.Dense(16, name="body")(x))
        return nn.Dense(3, name="head")(h)


class NnxNet(Net3):  # the user project's NNX classifier: 4 -> 16 -> 3 classes
    def __init__(self, rngs):
        super().__init__(16, rngs, classes=3)


class LinenGeneral(nn.Module):
    """Multi-axis kernels: DenseGeneral (flattened adapters) and Einsum."""

    @nn.compact
    def __call__(self, x, train=False):
        h = nn.DenseGeneral((2, 3), name="split")(x)  # kernel [4, 2, 3]
        h = nn.DenseGeneral(5, axis=(-2, -1), name="join")(h)  # kernel [2, 3, 5]
        return nn.Einsum((5, 3), "bf,fo->bo", name="out")(nn.relu(h))


class NnxRaw(nnx.Module):
    """An nnx.Einsum and a raw parameter used with `@`."""

    def __init__(self, rngs):
        self.proj = nnx.Einsum("bd,dhk->bhk", (4, 2, 4), rngs=rngs)
        self.w = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (8, 3)))

    def __call__(self, x):
        return self.proj(x).reshape(x.shape[0], 8) @ self.w[...]


TINY_LM = {"d_model": 16, "num_heads": 2, "d_ff": 32, "num_layers": 1, "max_len": 8,
           "vocab_size": 32}


def _data(n=64):
    r = np.random.default_rng(0)
    x = r.normal(size=(n, 4)).astype(np.float32)
    return {"inputs": x, "targets": (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0)}


def _cfg(total_steps=4, lora_cfg=None, **extra):
    return {"total_steps": total_steps, "seed": 0, "data": {"batch_size": 8},
            "eval": {"every_steps": 0}, "log": {"verbosity": 0, "writers": ("jsonl",)},
            "optim": {"name": "adamw", "lr": 0.05, "weight_decay": 0.1,
                      "schedule": "constant"},
            "finetune": {"lora": lora_cfg or {}}, **extra}


def _build(cfg, model=None, sample=None, target=None):
    data = _data()
    sample = data["inputs"][0] if sample is None else sample
    target = data["targets"][0] if target is None else target
    return jtrain.build(jtrain.resolve(cfg), sample=sample, model=model,
                        eval_example={"inputs": sample, "targets": target})


def _leaves(tree):
    return {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _apply(b, params, inputs) -> np.ndarray:
    """The built model's outputs (jitted, as in training and evaluation)."""
    return np.asarray(jax.jit(b.model_fns.apply)(params, inputs))


def _tree(template, flat: dict, prefix: str = ""):
    """The params tree of `template` with values `flat[prefix + path]`."""
    return jax.tree_util.tree_map_with_path(
        lambda p, _: flat[prefix + jax.tree_util.keystr(p, simple=True, separator="/")],
        template)


@pytest.mark.parametrize("model", [LinenNet(), NnxNet], ids=["linen", "nnx"])
def test_only_the_adapters_train(tmp_path, model):
    cfg = _cfg(lora_cfg={"rank": 2, "alpha": 4.0})
    b = _build(cfg, model)
    # adapters: body 4x2 + 2x16, head 16x2 + 2x3; frozen: kernels and biases
    assert b.trainable == {"train": (4, 78), "frozen": (4, 131)}
    init = _leaves(b.init().params)
    res = jtrain.train(cfg, str(tmp_path / "run"), model=model, train_data=_data())
    after = _leaves(res.state.params)
    assert sorted(init) == sorted(after) == sorted(
        f"{m}/{w}" for m in ("body", "head")
        for w in ("bias", "kernel", "kernel_lora_a", "kernel_lora_b"))
    for name in init:
        if lora.is_adapter(name):
            assert not np.array_equal(init[name], after[name]), name
        else:  # frozen under AdamW with weight decay: bitwise the same
            assert init[name].tobytes() == after[name].tobytes(), name
    assert not init["head/kernel_lora_b"].any()  # B starts at zero: step 0 = base model
    # Adam's moments exist for the adapters only (MaskedNode for the frozen base).
    shapes = sorted(x.shape for x in jax.tree.leaves(res.state.opt_state) if x.ndim)
    assert shapes == sorted([(4, 2), (2, 16), (16, 2), (2, 3)] * 2)
    masked = jax.tree.leaves(res.state.opt_state,
                             is_leaf=lambda x: isinstance(x, optax.MaskedNode))
    assert sum(isinstance(x, optax.MaskedNode) for x in masked) == 8  # mu, nu x 4 leaves
    # The config stays as resolved; the adapters' patterns are the run's record.
    workdir = tmp_path / "run"
    assert json.loads((workdir / "config.json").read_text())["optim"]["trainable"] == []
    decided = json.loads((workdir / "run.json").read_text())["decided"]
    assert decided["optim.trainable"] == {"value": [lora.ADAPTERS], "from": "finetune.lora",
                                          "configured": []}
    assert res.summary["decided"] == decided


def _random(abstract, seed=1):
    """Random values for every parameter, adapters included (B is zero at init), so
    merging has work to do."""
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(abstract))))
    return jax.tree.map(lambda x: 0.3 * jax.random.normal(next(keys), x.shape, x.dtype),
                        abstract)


MERGED = {  # the weights with adapters; the transformer: all but the (tied) embedding
    "linen": ["body/kernel", "head/kernel"], "nnx": ["body/kernel", "head/kernel"],
    "linen_general": ["join/kernel", "out/kernel", "split/kernel"],
    "nnx_raw": ["proj/kernel", "w"],
    "transformer": [f"layer_0/{w}" for w in ("attn/key", "attn/out", "attn/query",
                                             "attn/value", "mlp/wi", "mlp/wo")]}


@pytest.mark.parametrize("kind", list(MERGED))
def test_merged_plain_model_computes_what_the_adapted_one_does(kind):
    lora_cfg = {"rank": 2, "alpha": 4.0}
    if kind == "transformer":
        extra = {"model": TINY_LM, "data": {"batch_size": 8, "seq_len": 8}}
        tokens = np.arange(8, dtype=np.int32)
        args, inputs = (None, tokens, tokens), np.stack([(tokens * k) % 32 for k in range(8)])
    else:
        model = {"linen": LinenNet(), "nnx": NnxNet, "linen_general": LinenGeneral(),
                 "nnx_raw": NnxRaw}[kind]
        extra, args, inputs = {}, (model,), _data()["inputs"][:8]
    adapted = _build({**_cfg(lora_cfg=lora_cfg), **extra}, *args)
    plain = _build({**_cfg(), **extra}, *args)
    params = _random(adapted.abstract.params)
    tensors = _leaves(params)
    merged, names = lora.merge(tensors, rank=2, alpha=4.0)
    assert sorted(names) == MERGED[kind]
    assert sorted(merged) == sorted(_leaves(plain.abstract.params))
    want = _apply(adapted, params, inputs)
    got = _apply(plain, _tree(plain.abstract.params, merged), inputs)
    base = _apply(plain, _tree(plain.abstract.params, tensors), inputs)
    assert np.abs(want - base).max() > 1e-2  # the adapters change the outputs
    assert np.abs(want - got).max() < 1e-5
    # Under jax.grad (as in the train step) every adapter is used: a gradient for each,
    # also for same-shaped weights in one module (the transformer's query / key / value).
    grads = _leaves(jax.jit(jax.grad(lambda p: jax.numpy.sum(
        adapted.model_fns.apply(p, inputs) ** 2)))(params))
    assert all(grads[name].any() for name in tensors if lora.is_adapter(name))


def test_lora_finetune_of_a_pretrained_run_and_merged_export(tmp_path, capfd):
    base = jtrain.train(_cfg(), str(tmp_path / "base"), model=LinenNet(), train_data=_data())
    capfd.readouterr()
    cfg = _cfg(lora_cfg={"rank": 2, "alpha": 4.0},
               init={"path": str(tmp_path / "base")})
    ft = jtrain.train(cfg, str(tmp_path / "ft"), model=LinenNet(), train_data=_data())
    err = capfd.readouterr().err
    assert "4 leaves (params), 4 LoRA adapter leaves not in the source (fresh init: " \
           "body/kernel_lora_a" in err, err
    pretrained, tuned = _leaves(base.state.params), _leaves(ft.state.params)
    for name, value in tuned.items():  # the base weights are the pretrained run's
        if not lora.is_adapter(name):
            assert value.tobytes() == pretrained[name].tobytes(), name
    assert tuned["body/kernel_lora_b"].any()  # the adapters trained
    # --merge_lora: the plain model, loaded from the export, computes what the LoRA run does
    record = export_lib.export(str(tmp_path / "ft"), str(tmp_path / "export"), merge_lora=True)
    assert record["merged_lora"] == {"rank": 2, "alpha": 4.0, "merged": 2}
    assert record["num_params"] == 131
    exported = export_lib.load_export(str(tmp_path / "export"))
    plain = _build(_cfg(), LinenNet())
    x = _data()["inputs"][:8]
    want = _apply(_build(cfg, LinenNet()), ft.state.params, x)
    got = _apply(plain, _tree(plain.abstract.params, exported, "params/"), x)
    diff = np.abs(want - got).max()
    assert diff < 1e-5
    # a plain run's export: nothing to merge
    with pytest.raises(UsageError, match="--merge_lora: .* was not trained with LoRA"):
        export_lib.export(str(tmp_path / "base"), str(tmp_path / "x"), merge_lora=True)


@pytest.mark.parametrize("lora_cfg, model, key, why", [
    ({"rank": -1}, LinenNet(), "finetune.lora.rank", "must be >= 0"),
    ({"rank": 64}, LinenNet(), "finetune.lora.rank", "64 is above the dimensions of every "
     "adapted weight (the largest: 4, body/kernel (4, 16)); use a rank <= 4"),
    ({"rank": 2, "targets": "decoder"}, LinenNet(), "finetune.lora.targets",
     "'decoder' matches no parameter path of a matmul weight; paths look like "
     "'body/kernel', 'head/kernel'"),
    ({"rank": 2, "targets": "("}, LinenNet(), "finetune.lora.targets", "bad regex"),
    ({"rank": 2, "alpha": 0.0}, LinenNet(), "finetune.lora.alpha", "must be > 0"),
    ({"rank": 2}, (lambda rng, x: {"w": np.ones((4, 3), np.float32)},
                   lambda p, x: x @ p["w"]), "finetune.lora.rank", "an (init, apply) pair"),
])
def test_bad_lora_settings_are_config_errors(tmp_path, lora_cfg, model, key, why):
    with pytest.raises(ConfigError) as e:
        jtrain.train(_cfg(lora_cfg=lora_cfg), str(tmp_path / "run"), model=model,
                     train_data=_data())
    assert e.value.key == key and why in str(e.value), str(e.value)
    assert not (tmp_path / "run" / "checkpoints").exists()


class Tied(nn.Module):
    """A tied output embedding: the table enters the logits matmul transposed."""

    @nn.compact
    def __call__(self, x, train=False):
        table = nn.Embed(32, 8, name="tokens")
        return table.attend(nn.Dense(8, name="proj")(table(x)))


def test_a_weight_that_could_not_be_merged_is_refused():
    tokens = np.arange(8, dtype=np.int32)
    with pytest.raises(ConfigError) as e:
        _build(_cfg(lora_cfg={"rank": 2, "targets": "."}), Tied(), tokens, tokens)
    assert e.value.key == "finetune.lora.targets"
    assert str(e.value).startswith("finetune.lora.targets: tokens/embedding enters a matmul "
                                   "transposed"), str(e.value)
    b = _build(_cfg(lora_cfg={"rank": 2, "targets": "proj"}), Tied(), tokens, tokens)
    assert b.trainable["train"] == (2, 32)


def test_changing_lora_on_resume_is_a_named_config_change(tmp_path):
    run = str(tmp_path / "run")
    cfg = _cfg(total_steps=2, lora_cfg={"rank": 2, "alpha": 4.0})
    jtrain.train(cfg, run, model=LinenNet(), train_data=_data())
    cfg["total_steps"] = 3
    cfg["finetune"]["lora"]["alpha"] = 8.0  # same tree, another model: needs allow_changes
    with pytest.raises(RestoreError, match=r"finetune\.lora\.alpha 4\.0 -> 8\.0; to "
                                           r"resume anyway pass jtrain\.train\(\.\.\., "
                                           r"allow_changes=\['finetune\.lora\.alpha'\]\)"):
        jtrain.train(cfg, run, model=LinenNet(), train_data=_data())
    cfg["finetune"]["lora"]["rank"] = 3  # another tree: the leaf is named (as for d_model)
    with pytest.raises(RestoreError, match="does not fit the model: params/body/kernel_lora_a"):
        jtrain.train(cfg, run, model=LinenNet(), train_data=_data())
    cfg["finetune"]["lora"]["rank"] = 2
    cfg["checkpoint"] = {"allow_changes": ("finetune.lora.alpha",)}
    res = jtrain.train(cfg, run, model=LinenNet(), train_data=_data())
    assert res.summary["step"] == 3


# -- the user's journey: their NNX model by model.factory, the CLI, relative paths -------

SCRIPT = '''
import jtrain

config = {"model": {"name": "user", "factory": "nnx_mlp:make"},
          "data": {"source": "nnx_mlp:data", "batch_size": 8},
          "total_steps": 6, "eval": {"every_steps": 0}, "optim": {"lr": 0.05}}
jtrain.train(config, "runs/base")
config["finetune"] = {"lora": {"rank": 2, "alpha": 4.0}}
config["init"] = {"path": "runs/base"}
result = jtrain.train(config, "runs/ft")
print("ft step", result.summary["step"])
'''

CONFIG = '''
from jtrain.config import defaults


def get_config():
    config = defaults(model="user")
    config.update({"model": {"factory": "nnx_mlp:make"},
                   "data": {"source": "nnx_mlp:data", "batch_size": 8},
                   "total_steps": 2, "finetune": {"lora": {"rank": 2}}})
    return config
'''


_run = run_python


def _error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if " error: " in ln]


@pytest.mark.slow  # seconds of CPU: the full suite runs it (tests/README.md)
def test_user_pretrains_lora_finetunes_and_exports_merged(tmp_path, monkeypatch, capfd):
    user_dir(tmp_path, ["nnx_mlp"], {"finetune.py": SCRIPT, "myconfig.py": CONFIG})
    proc = _run(tmp_path, "finetune.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ft step 6" in proc.stdout
    assert "LoRA adapter leaves not in the source" in proc.stderr
    assert "jtrain: trainable 76 params in 4 leaves; frozen 114 in 4 leaves" in proc.stderr

    proc = _run(tmp_path, "-m", "jtrain.export", "runs/ft", "--merge_lora", "--out=exports/ft")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "jtrain: exported step 6: 114 params in 4 tensors (as saved) to exports/ft/" \
           "params.safetensors; LoRA merged into 2 weights (rank 2, alpha 4)" in proc.stdout
    info = json.loads((tmp_path / "exports/ft/export.json").read_text())
    assert info["merged_lora"] == {"rank": 2, "alpha": 4.0, "merged": 2}
    tensors, _ = export_lib.read_safetensors(str(tmp_path / "exports/ft/params.safetensors"))
    assert sorted(tensors) == ["encoder/bias", "encoder/kernel", "head/bias", "head/kernel"]

    # a run without LoRA has nothing to merge; a config that adapts nothing: the same
    # commands' one lines, run in this process (the journey's commands are the two above)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # as `python -m` puts the cwd on sys.path
    capfd.readouterr()
    assert jtrain.export.main(["runs/base", "--merge_lora", "--out=x"]) == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err and _error_lines(err) == [
        "jtrain: usage error: --merge_lora: runs/base was not trained with LoRA "
        "(finetune.lora.rank=0); export it without --merge_lora"], err[-3000:]
    assert not (tmp_path / "x").exists()
    with pytest.raises(SystemExit) as e:
        main_lib.cli(["jtrain", "--config=myconfig.py", "--workdir=runs/bad",
                      "--config.finetune.lora.targets=decoder"])
    err = capfd.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err[-3000:]
    assert _error_lines(err) == ["jtrain: config error: finetune.lora.targets: 'decoder' "
                                 "matches no parameter path of a matmul weight; paths "
                                 "look like 'encoder/kernel', 'head/kernel'"]
    assert not (tmp_path / "runs/bad/checkpoints").exists()

    # the merged export in the plain model = the fine-tuned LoRA model
    sys.path.insert(0, str(tmp_path))
    try:
        import nnx_mlp
        ft_cfg = {"finetune": {"lora": {"rank": 2, "alpha": 4.0}}}
        x = nnx_mlp.data()["inputs"][:8]
        adapted = _build({**_cfg(), **ft_cfg, "data": {"batch_size": 8}},
                         nnx_mlp.Model, x[0], np.int32(0))
        plain = _build(_cfg(), nnx_mlp.Model, x[0], np.int32(0))
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("nnx_mlp", None)
    step_dir = export_lib.find_step_dir(str(tmp_path / "runs/ft"))
    saved = export_lib.load_checkpoint_leaves(step_dir)

    want = _apply(adapted, _tree(adapted.abstract.params, saved, "params/"), x)
    got = _apply(plain, _tree(plain.abstract.params, tensors), x)
    assert np.abs(want - got).max() < 1e-5
