"""`python -m jtrain.export` (safetensors, no pickle) and `init.path`."""

import json
import os
import re
import struct

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jtrain import checkpoint
from jtrain.checkpoint import export
from jtrain import export as export_command
from test_checkpoint import abstract, make_config, make_state, open_run, same


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("exp") / "run"
    ck, _ = open_run(workdir)
    ck.save(3, make_state(3, 3.0), {"pos": 3})
    ck.save(7, make_state(7, 7.0), {"pos": 7})
    ck.close()
    return workdir


def test_safetensors_round_trip_and_plain_format(tmp_path):
    tensors = {"a/kernel": np.arange(6, dtype=np.float32).reshape(2, 3),
               "b": np.asarray([1, -2], np.int32),
               "c": np.asarray([0.5, 1.5], ml_dtypes.bfloat16)}
    path = str(tmp_path / "x.safetensors")
    export.write_safetensors(path, tensors, {"k": "v"})
    back, meta = export.read_safetensors(path)
    assert meta == {"k": "v"}
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and np.array_equal(back[k], v)
    raw = open(path, "rb").read()  # the documented layout: u64 header length, JSON, bytes
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    assert header["c"]["dtype"] == "BF16" and header["a/kernel"]["shape"] == [2, 3]
    with open(path, "r+b") as f:
        f.truncate(len(raw) - 3)
    with pytest.raises(export.ExportError, match="truncated"):
        export.read_safetensors(path)


def test_export_cli_params_only_and_bf16(run_dir, tmp_path, capsys):
    out = tmp_path / "exp"
    assert export_command.main([str(run_dir), "--step=3", f"--out={out}"]) == 0
    tensors, _ = export.read_safetensors(str(out / export.PARAMS_FILE))
    assert sorted(tensors) == ["dense/bias", "dense/kernel"]  # params only
    np.testing.assert_array_equal(tensors["dense/kernel"], np.full((8, 16), 3.0, np.float32))
    info = json.load(open(out / export.INFO_FILE))
    assert info["step"] == 3 and info["num_params"] == 8 * 16 + 16
    assert export_command.main([str(run_dir), f"--out={tmp_path / 'b16'}", "--dtype=bfloat16"]) == 0
    t16, _ = export.read_safetensors(str(tmp_path / "b16" / export.PARAMS_FILE))
    assert t16["dense/bias"].dtype == ml_dtypes.bfloat16  # newest step: 7
    assert float(t16["dense/bias"][1]) == 7.0
    assert export_command.main([str(run_dir), "--step=5", f"--out={tmp_path / 'no'}"]) == 3
    assert "jtrain: export error:" in capsys.readouterr().err


def test_init_from_export_casts_and_excludes(run_dir, tmp_path, capfd):
    out = tmp_path / "exp"
    export_command.main([str(run_dir), f"--out={out}", "--dtype=bfloat16"])
    cfg = make_config(path=str(out), exclude=("bias$",))
    ck, start = open_run(tmp_path / "new", cfg)
    ck.close()
    assert start.source == "init_from" and start.step is None and start.data_state is None
    s = start.state
    assert s.params["dense"]["kernel"].dtype == jnp.float32
    np.testing.assert_array_equal(s.params["dense"]["kernel"], np.full((8, 16), 7.0))
    np.testing.assert_array_equal(s.params["dense"]["bias"], make_state().params["dense"]["bias"])
    assert int(s.step) == 0
    err = capfd.readouterr().err
    assert "1 excluded (fresh init: dense/bias)" in err and "bfloat16->float32" in err


def test_init_from_checkpoint_with_optimizer_state(run_dir, tmp_path):
    cfg = make_config(path=str(run_dir), opt=True)
    ck, start = open_run(tmp_path / "new", cfg)
    ck.close()
    want = make_state(7, 7.0)
    assert same(start.state.params, want.params) and same(start.state.opt_state, want.opt_state)
    assert int(start.state.step) == 0


def test_workdir_checkpoint_wins_over_init_from(run_dir, tmp_path):
    cfg = make_config(path=str(tmp_path / "does-not-matter"))
    ck, start = open_run(run_dir, cfg)  # run_dir has checkpoints: precedence (1)
    ck.close()
    assert start.source == "checkpoint" and start.step == 7


def test_init_from_mismatch_and_missing_path(run_dir, tmp_path):
    cfg = make_config(path=str(run_dir))
    with pytest.raises(checkpoint.RestoreError,
                       match=re.escape(": dense/bias: source has (16,) float32, the "
                                       "model (32,) float32")):
        open_run(tmp_path / "a", cfg, state=make_state(width=32))
    with pytest.raises(checkpoint.RestoreError, match=": head/kernel .* is not in the source"):
        open_run(tmp_path / "b", cfg, state=make_state(extra=True))
    from jtrain.config import ConfigError

    with pytest.raises(ConfigError, match="init.path: .*no such file"):
        open_run(tmp_path / "c", make_config(path=str(tmp_path / "nope")))


def test_reader_is_read_only(run_dir):
    before = sorted(os.listdir(run_dir / "checkpoints"))
    reader = checkpoint.CheckpointReader(str(run_dir))
    assert reader.all_steps() == [3, 7]
    state, data, control = reader.restore(3, abstract(make_state()))
    assert same(state, make_state(3, 3.0)) and data == {"pos": 3}
    assert control["config"]["total_steps"] == 90
    assert sorted(os.listdir(run_dir / "checkpoints")) == before


def test_schedule_free_export_is_the_average_and_frozen_leaves_stay():
    """x = (y - (1 - b1) z) / b1 per leaf with a z; a frozen leaf (no z) as saved."""
    from jtrain.checkpoint.export import _schedule_free_average

    y = {"a/kernel": np.array([1.0, 2.0], np.float32), "a/bias": np.array([3.0], np.float32)}
    prefix = "opt_state/inner_states/train/inner_state/"
    loaded = {prefix + "b1": np.float32(0.9), prefix + "z/a/kernel": np.array([0.5, 4.0],
                                                                          np.float32)}
    out = _schedule_free_average(loaded, y, "ckpt/4")
    np.testing.assert_allclose(out["a/kernel"], (y["a/kernel"] - 0.1 * np.array([0.5, 4.0]))
                               / 0.9, rtol=1e-6)
    assert out["a/bias"] is y["a/bias"] and out["a/kernel"].dtype == np.float32


def test_a_schedule_free_runs_export_writes_the_average_not_the_iterate(tmp_path):
    """Through export(): a saved schedule-free state's params.safetensors holds optax's
    schedule_free_eval_params, not the raw iterate y the state keeps as params."""
    import dataclasses

    import jax
    import optax

    cfg = make_config()
    cfg.optim.name = "schedule_free_adamw"
    state = make_state(2, 2.0)
    tx = optax.contrib.schedule_free_adamw(1e-3)
    opt = tx.init(state.params)
    opt = opt._replace(z=jax.tree.map(lambda x: x * -3.0 + 1.0, opt.z))  # z far from y
    state = dataclasses.replace(state, opt_state=opt)
    ck, _ = open_run(tmp_path / "run", cfg, state)
    ck.save(2, state, {"pos": 2})
    ck.close()
    record = export.export(str(tmp_path / "run"), str(tmp_path / "out"))
    assert record["schedule_free_average"]
    got = export.load_export(str(tmp_path / "out"))
    want = optax.contrib.schedule_free_eval_params(opt, state.params)
    for name, arr in {"dense/kernel": want["dense"]["kernel"],
                      "dense/bias": want["dense"]["bias"]}.items():
        np.testing.assert_allclose(got["params/" + name], np.asarray(arr), rtol=1e-6)
        assert not np.allclose(got["params/" + name], np.asarray(state.params[name.split("/")[0]][
            name.split("/")[1]]))
