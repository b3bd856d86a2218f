"""The public pieces compose from a plain script: `jtrain.make_optimizer`, `make_mesh`,
`make_policy` and `make_model` take the keys a user cares about (a partial section) and
fill the schema's defaults; an unknown key or a bad value is one ConfigError naming it;
a section of a resolved config works unchanged."""

from __future__ import annotations

import textwrap

import jax.numpy as jnp
import pytest

import jtrain
from jtrain import config as config_lib
from jtrain.config import sections
from journey import run_python

SCRIPT = textwrap.dedent('''
    import jax.numpy as jnp
    import optax
    import jtrain

    tx, schedule = jtrain.make_optimizer({"name": "adamw", "lr": 0.1}, 10)
    params = {"w": jnp.ones((3,))}
    state = tx.init(params)
    updates, state = tx.update({"w": jnp.ones((3,))}, state, params)
    params = optax.apply_updates(params, updates)
    print("updated", [round(float(x), 4) for x in params["w"]], float(schedule(5)))
    mesh = jtrain.make_mesh({"fsdp": 1})
    print("mesh", dict(mesh.shape))
    print("policy", jtrain.make_policy({"dtype": "bfloat16"}).describe())
    jtrain.make_optimizer({"lrr": 1}, 10)
''')


def test_make_optimizer_from_a_partial_dict_in_a_script(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    proc = run_python(tmp_path, "script.py")
    out = proc.stdout.splitlines()
    assert out[0].startswith("updated [0.9, 0.9, 0.9] ") and float(out[0].split()[-1]) > 0
    assert out[1] == ("mesh {'data': 1, 'fsdp': 1, 'expert': 1, 'context': 1, 'tensor': 1, "
                      "'stage': 1}")
    assert out[2] == "policy params float32, compute bfloat16"
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last == 'jtrain.errors.ConfigError: optim.lrr: unknown key; did you mean "lr"?'


def test_the_one_line_a_script_prints_for_a_bad_key(tmp_path):
    (tmp_path / "script.py").write_text(textwrap.dedent('''
        import jtrain
        from jtrain import errors
        try:
            jtrain.make_optimizer({"lrr": 1}, 10)
        except jtrain.ConfigError as e:
            print(errors.render(e), "|", e.key, "|", e.why)
    '''))
    proc = run_python(tmp_path, "script.py")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ('jtrain: config error: optim.lrr: unknown key; did you '
                                   'mean "lr"? | optim.lrr | unknown key; did you mean "lr"?')


@pytest.mark.parametrize("call, key", [
    (lambda: jtrain.make_optimizer({"lr": -1.0}, 10), "optim.lr"),
    (lambda: jtrain.make_optimizer({"schedule": "cosine", "warmup_steps": 20}, 10),
     "optim.warmup_steps"),
    (lambda: jtrain.make_optimizer({"name": "adam", "b1": 1.0}, 10), "optim.b1"),
    (lambda: jtrain.make_optimizer({"lr": 0.1}, 0), "total_steps"),
    (lambda: jtrain.make_optimizer([("lr", 0.1)], 10), "optim"),
    (lambda: jtrain.make_mesh({"tensr": 1}), "mesh.tensr"),
    (lambda: jtrain.make_mesh({"data": 0}), "mesh.data"),
    (lambda: jtrain.make_mesh({"data": 7}), "mesh.data"),
    (lambda: jtrain.make_policy({"param_dtype": "float16"}), "model.param_dtype"),
    (lambda: jtrain.make_policy({"loss_scal": "none"}), "model.loss_scal"),
    (lambda: jtrain.make_model({"name": "mlp", "hidden": "x"}, dtype=jnp.float32,
                               param_dtype=jnp.float32), "model.hidden"),
])
def test_a_bad_key_or_value_is_a_config_error_naming_it(call, key):
    with pytest.raises(jtrain.ConfigError) as e:
        call()
    assert e.value.key == key, str(e.value)


def test_a_resolved_section_works_unchanged():
    cfg = config_lib.resolve({"optim": {"name": "sgd", "lr": 0.5, "warmup_steps": 3,
                                        "lr_mults": {"bias": 0.0}},
                              "data": {"batch_size": 48}, "total_steps": 20})
    assert sections.section("optim", cfg.optim, total_steps=20).to_dict() == \
        cfg.optim.to_dict()
    assert sections.section("mesh", cfg.mesh).to_dict() == cfg.mesh.to_dict()
    assert sections.section("model", cfg.model).to_dict() == cfg.model.to_dict()
    _, schedule = jtrain.make_optimizer(cfg.optim, cfg.total_steps)
    _, same = jtrain.make_optimizer({"name": "sgd", "lr": 0.5, "warmup_steps": 3,
                                     "lr_mults": {"bias": 0.0}}, 20)
    assert [float(schedule(s)) for s in range(20)] == [float(same(s)) for s in range(20)]
    assert jtrain.make_policy(cfg.model) == jtrain.make_policy({})


def test_the_optimizer_fills_the_schemas_defaults():
    """A partial section resolves as the whole config would: the schema's defaults and
    the named optimizer's own arguments (optim.kwargs) filled in."""
    partial = sections.section("optim", {"name": "sgd"}, total_steps=10)
    defaults = config_lib.defaults().optim.to_dict()
    assert partial.to_dict() == {**defaults, "name": "sgd",
                                 "kwargs": {"momentum": 0.9, "nesterov": False}}
    assert partial.to_dict() == jtrain.resolve(
        {"optim": {"name": "sgd"}, "total_steps": 10}).optim.to_dict()
