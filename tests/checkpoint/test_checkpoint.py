"""Checkpointer units (no training): the damaged-checkpoint table, the mismatched-model
table, config changes on resume, retention across resumes, background write failures,
donation with async saves, and never unpickling."""

import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jtrain import checkpoint, config as config_lib
from jtrain.checkpoint import integrity
from jtrain.state import TrainState


def make_config(**ckpt):
    """checkpoint.* and init.* (path, step, opt, exclude, map, into) by their names."""
    cfg = config_lib.defaults("mlp")
    cfg.total_steps = 90
    for key, value in ckpt.items():
        (cfg.init if key in cfg.init else cfg.checkpoint)[key] = value
    return cfg


def make_state(step=0, scale=1.0, width=16, dtype=jnp.float32, extra=False):
    params = {"dense": {"kernel": jnp.full((8, width), scale, dtype),
                        "bias": jnp.arange(width, dtype=dtype) * scale}}
    if extra:
        params["head"] = {"kernel": jnp.ones((width, 2), dtype)}
    tx = optax.adamw(1e-3)
    opt = jax.tree.map(lambda x: x + scale, tx.init(params))
    return TrainState(step=jnp.asarray(step, jnp.int32), params=params, opt_state=opt,
                      rng=jnp.asarray([1, 2], jnp.uint32),
                      loss_scale={"scale": jnp.float32(1), "good_steps": jnp.int32(0)},
                      skipped_steps=jnp.int32(0), consecutive_skips=jnp.int32(0),
                      halted_at=jnp.int32(0), lr_factor=jnp.float32(1))


def abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state)


def open_run(workdir, cfg=None, state=None):
    """A Checkpointer and its Start, as train() does."""
    cfg = cfg or make_config()
    ck = checkpoint.Checkpointer(str(workdir), cfg, {"name": "unit"})
    start = ck.restore_or_init(abstract(state or make_state()), lambda: make_state())
    return ck, start


def same(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """A workdir with intact checkpoints at steps 1 and 2."""
    workdir = tmp_path_factory.mktemp("base") / "run"
    ck, _ = open_run(workdir)
    ck.save(1, make_state(1, 1.0), {"pos": 1})
    ck.save(2, make_state(2, 2.0), {"pos": 2})
    ck.close()
    return workdir


def largest_file(d):
    files = [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs]
    return max(files, key=os.path.getsize)


def flip_byte(path, offset=None):
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        i = len(data) // 2 if offset is None else offset
        data[i] ^= 0x01
        f.seek(0)
        f.write(data)


def truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


def replace_by_symlink(path, outside):
    shutil.copytree(path, outside) if os.path.isdir(path) else shutil.copy(path, outside)
    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    os.symlink(outside, path)


# name -> (damage(ckpts_dir, outside_dir), restored step or None, expected path fragment)
# The path fragment is what the one warning line must name (None: no warning expected).
DAMAGE = {
    "killed_before_first_save": (
        lambda c, o: [shutil.rmtree(f"{c}/1"), os.rename(f"{c}/2", f"{c}/1.orbax-checkpoint-tmp")],
        None, "1.orbax-checkpoint-tmp"),
    "leftover_tmp_dir": (
        lambda c, o: shutil.copytree(f"{c}/2", f"{c}/3.orbax-checkpoint-tmp"), 2,
        "3.orbax-checkpoint-tmp"),
    "truncated_array_file": (
        lambda c, o: truncate(largest_file(f"{c}/2/state"), 10), 1, "/2/state/"),
    "zero_length_array_file": (
        lambda c, o: truncate(largest_file(f"{c}/2/state"), 0), 1, "/2/state/"),
    "flipped_byte_in_array": (lambda c, o: flip_byte(largest_file(f"{c}/2/state")), 1, "/2/state/"),
    "missing_array_file": (lambda c, o: os.remove(largest_file(f"{c}/2/state")), 1, "/2/state/"),
    "missing_orbax_step_metadata": (
        lambda c, o: os.remove(f"{c}/2/_CHECKPOINT_METADATA"), 1, "2/_CHECKPOINT_METADATA"),
    "orbax_step_metadata_not_json": (
        lambda c, o: open(f"{c}/2/_CHECKPOINT_METADATA", "w").write("{garbage"), 1,
        "2/_CHECKPOINT_METADATA"),
    "missing_tree_metadata": (lambda c, o: os.remove(f"{c}/2/state/_METADATA"), 1,
                              "2/state/_METADATA"),
    "missing_manifest": (lambda c, o: os.remove(f"{c}/2/{integrity.MANIFEST}"), 1,
                         "2/jtrain_manifest.json"),
    "manifest_not_json": (lambda c, o: open(f"{c}/2/{integrity.MANIFEST}", "w").write("{"), 1,
                          "2/jtrain_manifest.json"),
    "manifest_edited": (lambda c, o: _edit_manifest(f"{c}/2"), 1, "2/jtrain_manifest.json"),
    "missing_data_item": (lambda c, o: shutil.rmtree(f"{c}/2/data"), 1, "2/data/"),
    "data_json_damaged": (lambda c, o: flip_byte(f"{c}/2/data/metadata", 1), 1, "2/data/metadata"),
    "control_json_damaged": (lambda c, o: flip_byte(f"{c}/2/control/metadata"), 1,
                             "2/control/metadata"),
    "step_dir_is_a_file": (
        lambda c, o: [shutil.rmtree(f"{c}/2"), open(f"{c}/2", "w").write("x")], 1, "/2: is a file"),
    "step_dir_is_a_symlink": (
        lambda c, o: replace_by_symlink(f"{c}/2", f"{o}/two"), 1, "/2: is a symlink"),
    "symlink_inside_step": (
        lambda c, o: replace_by_symlink(largest_file(f"{c}/2/state"), f"{o}/blob"), 1, "symlink"),
    "empty_newer_step_dir": (lambda c, o: os.mkdir(f"{c}/3"), 2, "/3/jtrain_manifest.json"),
    "step_dir_renamed": (lambda c, o: shutil.copytree(f"{c}/2", f"{c}/5"), 2,
                         "records step 2, but the directory is step 5"),
    # A step directory renamed with leading zeros: orbax addresses step 2 as "2", so
    # "0002" is set aside (checkpoints.damaged/) like any damaged step, and the previous
    # intact step restores; a zero-padded copy of step 2 as "0005" is set aside the same.
    "step_dir_leading_zeros": (lambda c, o: os.rename(f"{c}/2", f"{c}/0002"), 1,
                               "/0002: not a step directory name jtrain writes"),
    "newer_step_dir_leading_zeros": (lambda c, o: shutil.copytree(f"{c}/2", f"{c}/0005"), 2,
                                     "/0005: not a step directory name jtrain writes"),
    "all_damaged": (lambda c, o: [os.remove(f"{c}/{s}/{integrity.MANIFEST}") for s in (1, 2)],
                    None, "2/jtrain_manifest.json"),
    "unrelated_file_in_dir": (lambda c, o: open(f"{c}/notes.txt", "w").write("hi"), 2, None),
}


def _edit_manifest(step_dir):
    path = f"{step_dir}/{integrity.MANIFEST}"
    m = json.load(open(path))
    rel = sorted(m["files"])[0]
    m["files"][rel][1] ^= 1  # valid JSON, wrong content
    json.dump(m, open(path, "w"))


@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_damaged_checkpoint_falls_back_with_one_line(name, base_run, tmp_path, capfd):
    damage, expect_step, fragment = DAMAGE[name]
    workdir, outside = tmp_path / "run", tmp_path / "outside"
    shutil.copytree(base_run, workdir, symlinks=True)
    outside.mkdir()
    ckpts = str(workdir / "checkpoints")
    damage(ckpts, str(outside))
    capfd.readouterr()
    ck, start = open_run(workdir)
    err = capfd.readouterr().err
    ck.close()
    assert start.step == expect_step
    if expect_step is None:
        assert start.source == "fresh" and same(start.state, make_state())
    else:
        assert same(start.state, make_state(expect_step, float(expect_step)))
        assert start.data_state == {"pos": expect_step}
    lines = [ln for ln in err.splitlines() if ln.startswith("jtrain: warning")]
    if fragment is None:
        assert not lines, err
    else:
        assert lines and fragment in lines[0], err
        assert len(lines) == (2 if name == "all_damaged" else 1), err
    # Nothing was deleted through a symlink: the targets are intact.
    for target in outside.iterdir():
        assert target.exists()
    if name == "step_dir_is_a_symlink":
        assert integrity.check_step(str(outside / "two"), 2) is None


STRICT_OK = {"killed_before_first_save", "leftover_tmp_dir", "unrelated_file_in_dir"}


@pytest.mark.parametrize("name", sorted(set(DAMAGE) - STRICT_OK))
def test_strict_restore_raises_instead(name, base_run, tmp_path):
    damage, _, fragment = DAMAGE[name]
    workdir, outside = tmp_path / "run", tmp_path / "outside"
    shutil.copytree(base_run, workdir, symlinks=True)
    outside.mkdir()
    damage(str(workdir / "checkpoints"), str(outside))
    listing = sorted(os.listdir(workdir / "checkpoints"))
    with pytest.raises(checkpoint.RestoreError, match=re.escape(fragment)):
        open_run(workdir, make_config(strict_restore=True))
    assert sorted(os.listdir(workdir / "checkpoints")) == listing  # strict moves nothing


MISMATCH = {
    "shape": (dict(width=32), "params/dense/bias: checkpoint has (16,) float32, the model (32,)"),
    "dtype": (dict(dtype=jnp.bfloat16), "checkpoint has (16,) float32, the model (16,) bfloat16"),
    "extra_leaf_in_model": (dict(extra=True),
                            "params/head/kernel: in the model ((16, 2) float32) but not in"),
}


@pytest.mark.parametrize("name", sorted(MISMATCH) + ["missing_leaf_in_model"])
def test_mismatched_model_names_leaf_and_both_shapes(name, base_run, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(base_run, workdir)
    if name == "missing_leaf_in_model":
        # The checkpoint holds a head the model lacks.
        ck, _ = open_run(tmp_path / "other", state=make_state(extra=True))
        ck.save(1, make_state(1, extra=True), {})
        ck.close()
        with pytest.raises(checkpoint.RestoreError,
                           match=re.escape("params/head/kernel: in the checkpoint ((16, 2) "
                                           "float32) but not in the model")):
            open_run(tmp_path / "other")
        return
    kwargs, message = MISMATCH[name]
    with pytest.raises(checkpoint.RestoreError, match=re.escape(message)):
        open_run(workdir, state=make_state(**kwargs))


def test_changed_config_refuses_with_diff_unless_allowed(base_run, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(base_run, workdir)
    cfg = make_config()
    cfg.optim.lr = 0.5
    cfg.log.every_steps = 7  # harmless: recorded, never refused
    with pytest.raises(checkpoint.RestoreError) as e:
        open_run(workdir, cfg)
    msg = str(e.value)
    assert "optim.lr 0.001 -> 0.5" in msg and "log.every_steps" not in msg
    assert "--config.checkpoint.allow_changes=optim.lr" in msg and "\n" not in msg
    cfg.checkpoint.allow_changes = ("optim.*",)
    ck, start = open_run(workdir, cfg)
    assert start.step == 2
    ck.save(3, make_state(3), {})
    ck.close()
    with open(workdir / "checkpoints" / "3" / "control" / "metadata") as f:
        record = json.load(f)
    assert record["config_changes"][0]["changes"]["optim.lr"] == [0.001, 0.5]
    assert record["config_changes"][0]["allowed"] == ["optim.*"]
    assert record["config"]["optim"]["lr"] == 0.5


def test_retention_latest_topk_across_two_resumes(tmp_path):
    """max_to_keep=2, keep_top_k=2 with mode=max (so the best are not the latest);
    three sessions (two resumes): exactly latest-2 ∪ top-2 each time."""
    cfg = make_config(max_to_keep=2, keep_top_k=2, mode="max", monitor="eval/loss")
    values = {10: 5.0, 20: 3.0, 30: 4.0, 40: 6.0, 50: 1.0, 60: 2.0, 70: 0.5, 80: 7.0, 90: 0.1}
    expected = [[10, 20, 30], [10, 40, 50, 60], [40, 80, 90]]
    for session, steps in enumerate(([10, 20, 30], [40, 50, 60], [70, 80, 90])):
        ck, start = open_run(tmp_path / "run", cfg)
        assert start.step == (None if session == 0 else steps[0] - 10)
        for s in steps:
            ck.save(s, make_state(s), {"pos": s},
                    evals=[{"step": s - 5, "eval/loss": 99.0},  # not a checkpoint step
                           {"step": s, "eval/loss": values[s]}])
        ck.close()
        on_disk = sorted(int(n) for n in os.listdir(tmp_path / "run" / "checkpoints"))
        assert on_disk == expected[session], (session, on_disk)


def test_latest_is_never_deleted_for_a_better_one(tmp_path):
    cfg = make_config(max_to_keep=1, keep_top_k=1, mode="min")
    ck, _ = open_run(tmp_path / "run", cfg)
    for s, v in ((1, 0.1), (2, 5.0), (3, 9.0)):
        ck.save(s, make_state(s), {}, evals=[{"step": s, "eval/loss": v}])
    ck.close()
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["1", "3"]


def test_failed_background_write_surfaces_and_step_is_not_finished(tmp_path, monkeypatch):
    ck, _ = open_run(tmp_path / "run")
    ck.save(1, make_state(1), {})
    ck.wait()

    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(integrity, "write_manifest", broken)
    ck.save(2, make_state(2), {})  # returns: the write is in the background
    with pytest.raises(checkpoint.CheckpointError, match="step 2 .*No space left"):
        ck.save(3, make_state(3), {})
    monkeypatch.undo()
    ck.close()  # the error was reported once, at the next save
    assert checkpoint.CheckpointReader(str(tmp_path / "run")).all_steps() == [1]
    ck2, start = open_run(tmp_path / "run")
    ck2.close()
    assert start.step == 1


def test_async_save_then_donating_steps_is_safe(tmp_path):
    state = make_state(1, 3.0, width=512)
    expected = jax.tree.map(np.array, state)
    step = jax.jit(lambda s: jax.tree.map(lambda x: x * 2, s), donate_argnums=0)
    ck, _ = open_run(tmp_path / "run", state=state)
    ck.save(1, state, {})
    for _ in range(3):
        state = step(state)  # donates the arrays the save was given
    ck.close()
    reader = checkpoint.CheckpointReader(str(tmp_path / "run"))
    restored, _, _ = reader.restore(1, abstract(make_state(width=512)))
    assert same(restored, expected)


def test_every_seconds_and_every_steps(tmp_path, monkeypatch):
    cfg = make_config(every_steps=5, every_seconds=100.0)
    ck, _ = open_run(tmp_path / "run", cfg)
    clock = [1000.0]
    monkeypatch.setattr(checkpoint.manager.time, "monotonic", lambda: clock[0])
    ck._last_save = 1000.0
    assert ck.due(5) and not ck.due(6)
    clock[0] += 101
    assert ck.due(7)
    ck.close()


def test_no_load_path_unpickles():
    pkg = os.path.dirname(os.path.dirname(checkpoint.__file__))
    # Every module on a checkpoint's load path: the checkpoint and control packages.
    names = [os.path.join(pkg, sub, f) for sub in ("checkpoint", "control")
             for f in os.listdir(os.path.join(pkg, sub)) if f.endswith(".py")]
    assert len(names) >= 10
    for name in names:
        text = open(name).read()
        assert not re.search(r"import pickle|pickle\.load|allow_pickle\s*=\s*True|np\.load\("
                             r"|torch\.load|cloudpickle|dill", text), name


def test_bench_checkpoint_smoke(capsys):
    from jtrain.bench import main as bench_main

    assert bench_main(["checkpoint", "--rounds=0"]) == 2
    assert bench_main(["checkpoint", "--params=3e5", "--rounds=1", "--steps=1"]) == 0
    out = capsys.readouterr().out
    assert "loop blocked by a save: async" in out and "restore" in out and "steps/s" in out
