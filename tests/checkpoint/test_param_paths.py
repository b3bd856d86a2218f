"""One path convention for every parameter pattern: `optim.frozen` / `trainable` /
`lr_mults`, `init.exclude` / `init_map` and `finetune.lora.targets` all search
the parameter's path in the params tree (`o/kernel`, no `params/`), and a pattern that
matches nothing is a config error naming its key, before the first step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import jtrain
from jtrain import checkpoint, optim
from jtrain.config import sections
from jtrain.errors import ConfigError
from jtrain.state import TrainState
from journey import run_python
from test_checkpoint import abstract, make_config


class Net(nn.Module):
    """A body and a head named `o`: `^o/` selects the head's two leaves only."""
    out_name: str = "o"

    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name=self.out_name)(nn.relu(nn.Dense(8, name="hidden")(x)))


def make_state(seed, out_name="o", ema=False):
    params = Net(out_name).init(jax.random.key(seed), jnp.ones((1, 4)))["params"]
    params = jax.tree.map(lambda x: x + seed, params)  # biases too differ between seeds
    opt = jax.tree.map(lambda x: x + seed, optax.adamw(1e-3).init(params))
    return TrainState(step=jnp.asarray(0, jnp.int32), params=params, opt_state=opt,
                      rng=jnp.asarray([1, 2], jnp.uint32),
                      loss_scale={"scale": jnp.float32(1), "good_steps": jnp.int32(0)},
                      skipped_steps=jnp.int32(0), consecutive_skips=jnp.int32(0),
                      halted_at=jnp.int32(0), lr_factor=jnp.float32(1),
                      ema=jax.tree.map(lambda x: x + 100.0, params) if ema else None)


def leaves(tree) -> dict:
    return {optim.leaf_path(p): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A run's checkpoint (with a weight EMA) and the state it holds."""
    workdir = tmp_path_factory.mktemp("src") / "run"
    state = make_state(1, ema=True)
    ck = checkpoint.Checkpointer(str(workdir), make_config(), {"name": "unit"})
    ck.restore_or_init(abstract(state), lambda: state)
    ck.save(5, state, {"pos": 5})
    ck.close()
    return workdir, state


def start_from(workdir, fresh, **ckpt):
    ck = checkpoint.Checkpointer(str(workdir), make_config(**ckpt), {"name": "unit"})
    try:
        return ck.restore_or_init(abstract(fresh), lambda: fresh).state
    finally:
        ck.close()


def test_one_pattern_selects_the_same_leaves_for_freezing_and_init_exclude(source,
                                                                           tmp_path):
    src, src_state = source
    fresh = make_state(2)
    cfg = sections.section("optim", {"frozen": ["^o/"]}, total_steps=10)
    split = optim.trainable_split(fresh.params, cfg)
    labels = leaves(optim.trainable_labels(fresh.params, frozen=["^o/"]))
    frozen = {path for path, label in labels.items() if label == "frozen"}
    assert frozen == {"o/bias", "o/kernel"} and split["frozen"][0] == 2

    got = leaves(start_from(tmp_path / "new", fresh, path=str(src),
                            exclude=("^o/",)).params)
    kept_fresh = {p for p, v in got.items() if np.array_equal(v, leaves(fresh.params)[p])
                  and not np.array_equal(v, leaves(src_state.params)[p])}
    assert kept_fresh == frozen


def test_init_exclude_keeps_the_fresh_init_of_params_their_opt_state_and_ema(
        source, tmp_path, capfd):
    src, src_state = source
    fresh = make_state(2, ema=True)
    state = start_from(tmp_path / "new", fresh, path=str(src), exclude=("^o/",),
                       opt=True)
    got, was, new = leaves(state.params), leaves(src_state.params), leaves(fresh.params)
    for path in got:
        want = new if path.startswith("o/") else was
        assert got[path].tobytes() == want[path].tobytes(), path
        assert not np.array_equal(got[path], (was if want is new else new)[path]), path
    # the optimizer state of o/* stays fresh too; the body's is the source's
    opt, opt_src, opt_new = (leaves(s.opt_state) for s in (state, src_state, fresh))
    assert any(p.endswith("mu/o/kernel") for p in opt)
    for path in opt:
        want = opt_new if path.endswith(("/o/kernel", "/o/bias")) else opt_src
        assert opt[path].tobytes() == want[path].tobytes(), path
    # the average of an excluded parameter starts at its fresh value, the others' are taken
    ema = leaves(state.ema)
    assert ema["o/kernel"].tobytes() == new["o/kernel"].tobytes()
    assert ema["hidden/kernel"].tobytes() == (was["hidden/kernel"] + 100.0).tobytes()
    err = capfd.readouterr().err
    assert "6 excluded (fresh init: o/bias, o/kernel, opt_state/" in err, err


def test_a_pattern_with_the_old_params_prefix_is_read_without_it(source, tmp_path, capfd):
    src, src_state = source
    fresh = make_state(2)
    got = leaves(start_from(tmp_path / "new", fresh, path=str(src),
                            exclude=("^params/o/",)).params)
    assert got["o/kernel"].tobytes() == leaves(fresh.params)["o/kernel"].tobytes()
    assert got["hidden/kernel"].tobytes() == leaves(src_state.params)["hidden/kernel"].tobytes()
    err = capfd.readouterr().err
    assert "jtrain: note: init.exclude: '^params/o/' is read as '^o/'" in err
    assert "2 excluded (fresh init: o/bias, o/kernel)" in err


def test_init_map_renames_a_parameter_with_its_optimizer_state(source, tmp_path):
    src, src_state = source
    fresh = make_state(2, out_name="head")
    state = start_from(tmp_path / "new", fresh, path=str(src), opt=True,
                       map=((r"^o/(.*)", r"head/\1"),))
    got, was = leaves(state.params), leaves(src_state.params)
    assert got["head/kernel"].tobytes() == was["o/kernel"].tobytes()
    opt, opt_src = leaves(state.opt_state), leaves(src_state.opt_state)
    mu = [p for p in opt if p.endswith("mu/head/kernel")]
    assert mu and opt[mu[0]].tobytes() == opt_src[mu[0].replace("head/", "o/")].tobytes()


@pytest.mark.parametrize("ckpt, key", [
    ({"exclude": ("^out/",)}, "init.exclude"),
    ({"exclude": ("^params/out/",)}, "init.exclude"),
    ({"map": ((r"^head/(.*)", r"o/\1"),)}, "init.map"),
])
def test_a_pattern_that_matches_no_parameter_is_a_config_error(source, tmp_path, ckpt, key):
    src, _ = source
    with pytest.raises(ConfigError) as e:
        start_from(tmp_path / "new", make_state(2), path=str(src), **ckpt)
    assert e.value.key == key
    assert "matches no parameter" in str(e.value) and "'hidden/bias'" in str(e.value)


def test_lora_targets_are_parameter_paths(tmp_path):
    r = np.random.default_rng(0)
    x = r.normal(size=(32, 4)).astype(np.float32)
    data = {"inputs": x, "targets": (x[:, 0] > 0).astype(np.int32)}
    cfg = {"total_steps": 1, "data": {"batch_size": 8}, "eval": {"every_steps": 0},
           "finetune": {"lora": {"rank": 2, "targets": "^o/kernel$"}}}
    result = jtrain.train(cfg, str(tmp_path / "a"), model=Net(), train_data=data)
    adapters = sorted(p for p in leaves(result.state.params) if "_lora_" in p)
    assert adapters == ["o/kernel_lora_a", "o/kernel_lora_b"]
    cfg["finetune"]["lora"]["targets"] = "^out/"
    with pytest.raises(ConfigError) as e:
        jtrain.train(cfg, str(tmp_path / "b"), model=Net(), train_data=data)
    assert e.value.key == "finetune.lora.targets"


MODEL = '''
import numpy as np
from flax import nnx


class Model(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(4, 8, rngs=rngs)
        self.o = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.o(nnx.relu(self.hidden(x)))


def make():
    return Model


def data():
    r = np.random.default_rng(0)
    x = r.normal(size=(64, 4)).astype(np.float32)
    return {"inputs": x, "targets": (x[:, 0] > 0).astype(np.int32)}
'''

CONFIG = '''
from jtrain.config import defaults


def get_config():
    config = defaults(model="user")
    config.model.factory = "mymodel:make"
    config.data.source = "mymodel:data"
    config.data.batch_size = 8
    config.total_steps = 3
    config.eval.every_steps = 0
    return config
'''


def test_user_starts_a_new_head_from_a_run(tmp_path):
    (tmp_path / "mymodel.py").write_text(MODEL)
    (tmp_path / "cfg.py").write_text(CONFIG)
    proc = run_python(tmp_path, "-m", "jtrain.main", "--config=cfg.py", "--workdir=runs/src")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_python(tmp_path, "-m", "jtrain.main", "--config=cfg.py", "--workdir=runs/ft",
                      "--config.init.path=runs/src",
                      "--config.init.exclude=('^o/',)",
                      "--config.optim.frozen=('^hidden/',)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "jtrain: trainable 18 params in 2 leaves; frozen 40 in 2 leaves" in proc.stderr
    assert "2 excluded (fresh init: o/bias, o/kernel)" in proc.stderr, proc.stderr[-3000:]
    assert "; initialized from runs/src (step 3, 2 leaves, 2 excluded)" in proc.stderr

    proc = run_python(tmp_path, "-m", "jtrain.main", "--config=cfg.py", "--workdir=runs/bad",
                      "--config.init.path=runs/src",
                      "--config.init.exclude=('^out/',)")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if " error: " in ln]
    assert errors == ["jtrain: config error: init.exclude: '^out/' matches no "
                      "parameter path; paths look like 'hidden/bias', 'hidden/kernel', "
                      "'o/bias'"], proc.stderr[-3000:]
