"""Two-tier checkpoints (jtrain/checkpoint/tiers.py): which tier saves a step and the
invariant that bounds the local tier's lead (pure functions); a restart restores the
newest intact step across both tiers: the local one when it is newer, the persistent
one when the local folder is empty or missing, or when the local step is torn (set
aside in one warning line); lost_local deletes the local tier (in-process, a tiny
state, no training). The user's journey, a run killed three ways from the command
line, is tests/checkpoint/test_tiers_journey.py."""

import json
import os
import shutil

import pytest

import jtrain
from jtrain import errors
from jtrain.checkpoint import integrity, tiers
from jtrain.control import faults

from test_checkpoint import (abstract, flip_byte, largest_file, make_config, make_state, same,
                             truncate)


@pytest.mark.parametrize("local, persistent, tier", [
    (8, 5, "local"), (None, 5, "persistent"), (4, 5, "persistent"), (5, 5, "persistent"),
    (3, None, "local"), (None, None, None)])
def test_the_newer_tier_wins_and_a_tie_is_persistent(local, persistent, tier):
    assert tiers.newer_tier(local, persistent) == tier


@pytest.mark.parametrize("every, local_every", [(5, 2), (10, 3), (4, 4), (6, 7), (1, 1)])
def test_the_local_tier_is_never_a_persistent_interval_ahead(every, local_every):
    assert tiers.lag(37, every, local_every) < every
    assert tiers.save_tier(2 * every, every, local_every, True) == "persistent"
    assert tiers.save_tier(local_every, every, local_every, False) == "local"
    assert tiers.save_tier(local_every + 1, every, 2 * local_every + 2, False) is None


def cfg_for(local_dir, **ckpt):
    return make_config(local_dir=str(local_dir), local_every_steps=2, every_steps=5,
                       async_save=False, **ckpt)


def open_tiers(workdir, local_dir):
    ck = tiers.open_checkpoints(str(workdir), cfg_for(local_dir), {"name": "unit"})
    start = ck.restore_or_init(abstract(make_state()), lambda: make_state())
    return ck, start


def save_steps(ck, steps):
    """Each step saved where the loop would save it (`due`, then `save`)."""
    for step in steps:
        if ck.due(step):
            ck.save(step, make_state(step, float(step)), {"pos": step})


@pytest.fixture
def two_tiers(tmp_path):
    """(workdir, local_dir): persistent steps 5 (and 10), local step 8 (then 12)."""
    workdir, local_dir = tmp_path / "run", tmp_path / "local"
    ck, start = open_tiers(workdir, local_dir)
    assert start.source == "fresh"
    save_steps(ck, range(1, 9))
    ck.close()
    return workdir, local_dir


def local_steps(ck):
    return sorted(int(n) for n in os.listdir(ck.local.directory) if n.isdigit())


def test_local_newer_restores_the_local_step_exactly(two_tiers, capsys):
    workdir, local_dir = two_tiers
    ck, start = open_tiers(workdir, local_dir)
    assert ck.persistent.all_steps() == [5] and local_steps(ck) == [8]
    assert (start.step, start.source, start.data_state) == (8, "checkpoint", {"pos": 8})
    assert start.origin == "resumed from step 8 (local tier)"
    assert same(start.state, make_state(8, 8.0))
    assert ck.local.directory.startswith(str(local_dir) + os.sep)
    # What --verify_resume reads to know where a restart resumes from.
    assert tiers.local_steps(str(workdir), str(local_dir)) == [8]
    assert tiers.local_steps(str(local_dir), str(local_dir)) == []  # not a workdir
    # The local tier keeps its newest step; a step the persistent tier saves is not local.
    save_steps(ck, range(9, 13))
    assert ck.persistent.all_steps() == [5, 10] and local_steps(ck) == [12]
    ck.close()


@pytest.mark.parametrize("how", ["emptied", "missing"])
def test_a_replaced_machine_falls_back_to_the_persistent_tier(two_tiers, how):
    workdir, local_dir = two_tiers
    if how == "missing":
        shutil.rmtree(local_dir)
    else:
        for name in os.listdir(local_dir):
            shutil.rmtree(local_dir / name / "8")
    ck, start = open_tiers(workdir, local_dir)
    assert (start.step, start.origin, start.data_state) == (5, "resumed from step 5",
                                                            {"pos": 5})
    assert same(start.state, make_state(5, 5.0))
    ck.close()


@pytest.mark.parametrize("damage", [lambda f: truncate(f, 10), flip_byte],
                         ids=["cut_short", "flipped_byte"])
def test_a_torn_local_step_is_set_aside_and_the_persistent_one_restored(two_tiers, capsys,
                                                                        damage):
    workdir, local_dir = two_tiers
    (folder,) = [local_dir / n for n in os.listdir(local_dir)]
    damage(largest_file(folder / "8" / "state" / "ocdbt.process_0" / "d"))  # array data
    ck, start = open_tiers(workdir, local_dir)
    assert (start.step, start.origin) == (5, "resumed from step 5")
    assert same(start.state, make_state(5, 5.0))
    err = capsys.readouterr().err
    assert f"{folder}/8/state/ocdbt.process_0/d/" in err, err
    assert f"moved to {folder}.damaged/8" in err, err
    assert [n.split(".")[0] for n in os.listdir(str(folder) + ".damaged")] == ["8"]
    ck.close()


def test_an_unfinished_local_save_is_removed(two_tiers, capsys):
    workdir, local_dir = two_tiers
    (folder,) = [local_dir / n for n in os.listdir(local_dir)]
    shutil.copytree(folder / "8", folder / f"10{integrity.TMP_MARK}")
    ck, start = open_tiers(workdir, local_dir)
    assert start.step == 8 and "an unfinished save (killed while writing); removed" in \
        capsys.readouterr().err
    ck.close()


def test_another_workdir_never_reads_this_local_tier(two_tiers, tmp_path):
    _, local_dir = two_tiers
    ck, start = open_tiers(tmp_path / "other", local_dir)
    assert start.source == "fresh" and len(os.listdir(local_dir)) == 2
    ck.close()


def test_lost_local_deletes_the_local_tier(two_tiers, monkeypatch):
    workdir, local_dir = two_tiers
    cfg = cfg_for(local_dir)
    cfg.debug.faults = "lost_local@9"
    faults.arm_plan(cfg, None)
    kills = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: kills.append(sig))
    ck = tiers.open_checkpoints(str(workdir), cfg, {"name": "unit"})
    ck.restore_or_init(abstract(make_state()), lambda: make_state())
    faults.fault_point("step", step=8)
    assert local_steps(ck) == [8] and not kills
    faults.fault_point("step", step=9)
    assert not os.path.exists(ck.local.directory) and len(kills) == 1
    ck.close()
    faults.arm_plan(make_config(), None)


@pytest.mark.parametrize("ckpt, faults_text, why", [
    ({"local_dir": "tier"}, "", "checkpoint.local_every_steps: the local checkpoint tier "
     "needs both"),
    ({"local_every_steps": 3}, "", "checkpoint.local_dir: the local checkpoint tier needs"),
    ({"local_dir": "s3://bucket/x", "local_every_steps": 3}, "",
     "checkpoint.local_dir: 's3://bucket/x' is not a local path"),
    ({}, "lost_local@3", "debug.faults: 'lost_local@3' deletes the local checkpoint tier: "
     "set checkpoint.local_dir"),
    ({"local_dir": "tier", "local_every_steps": 3}, "lost_local@3:p1",
     "lost_local takes no process"),
])
def test_bad_local_tier_settings_are_one_line(ckpt, faults_text, why):
    with pytest.raises(jtrain.ConfigError) as e:
        jtrain.resolve({"model": {"name": "mlp"}, "total_steps": 40, "checkpoint": ckpt,
                        "debug": {"faults": faults_text}})
    line = errors.render(e.value)
    assert line.startswith("jtrain: config error: ") and why in line, line
    assert "\n" not in line and errors.exit_code(e.value) == 2


def test_a_multi_process_run_with_a_local_tier_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(tiers.jax, "process_count", lambda: 2)
    with pytest.raises(jtrain.ConfigError) as e:
        tiers.open_checkpoints(str(tmp_path / "run"), cfg_for(tmp_path / "local"))
    assert errors.render(e.value) == (
        "jtrain: config error: checkpoint.local_dir: the local tier is implemented for one "
        "process only; unset it for a multi-process run")
    assert not (tmp_path / "local").exists()


def victim_folder(path):
    """A folder the local tier must never touch: a file, a step, an unfinished save and a
    step name with leading zeros (what a tier scan deletes or moves aside)."""
    (path / "7").mkdir(parents=True)
    (path / f"9{integrity.TMP_MARK}x").mkdir()
    (path / "0030").mkdir()
    (path / "notes.txt").write_text("mine")
    return sorted(os.listdir(path))


@pytest.mark.parametrize("run_id", ["../victim", "{abs}", "0123456789abcdef/..", "x" * 16, 7])
def test_an_id_that_is_not_a_plain_token_is_one_line(tmp_path, run_id):
    workdir, local_dir, victim = tmp_path / "run", tmp_path / "local", tmp_path / "victim"
    before = victim_folder(victim)
    workdir.mkdir()
    run_id = str(victim) if run_id == "{abs}" else run_id
    (workdir / tiers.ID_FILE).write_text(json.dumps({"id": run_id}))
    with pytest.raises(jtrain.ConfigError) as e:
        open_tiers(workdir, local_dir)
    line = errors.render(e.value)
    assert line.startswith(f"jtrain: config error: checkpoint.local_dir: {workdir}/"
                           f"{tiers.ID_FILE}: id {run_id!r} is not an id jtrain writes"), line
    assert "\n" not in line and sorted(os.listdir(victim)) == before
    assert tiers.local_steps(str(workdir), str(local_dir)) == []


def test_a_linked_local_folder_is_refused(two_tiers, tmp_path):
    workdir, local_dir = two_tiers
    (folder,) = [local_dir / n for n in os.listdir(local_dir)]
    shutil.rmtree(folder)
    before = victim_folder(tmp_path / "victim")
    os.symlink(tmp_path / "victim", folder)
    with pytest.raises(jtrain.ConfigError) as e:
        open_tiers(workdir, local_dir)
    assert errors.render(e.value) == (
        f"jtrain: config error: checkpoint.local_dir: {folder} is a symbolic link: the "
        "local tier writes and deletes only in a folder of its own; remove the link")
    assert sorted(os.listdir(tmp_path / "victim")) == before
    assert tiers.local_steps(str(workdir), str(local_dir)) == []


def test_the_id_file_replaces_a_dangling_link_instead_of_writing_through_it(tmp_path):
    workdir, target = tmp_path / "run", tmp_path / "elsewhere" / "planted.json"
    workdir.mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(target, workdir / tiers.ID_FILE)
    ck, start = open_tiers(workdir, tmp_path / "local")
    ck.close()
    assert start.source == "fresh" and not target.exists()
    assert not os.path.islink(workdir / tiers.ID_FILE)
    run_id = json.loads((workdir / tiers.ID_FILE).read_text())["id"]
    assert os.listdir(tmp_path / "local") == [run_id]


def test_a_copied_workdir_starts_its_own_tier_and_keeps_off_the_originals(two_tiers, tmp_path,
                                                                         capsys):
    """cp -r of a workdir: both copies name one local folder in local_tier.json. The copy
    finds the original's identity recorded there and starts a fresh tier (one warning);
    its saves never prune the original's step 8."""
    workdir, local_dir = two_tiers
    copy = tmp_path / "copy"
    shutil.copytree(workdir, copy)
    (original,) = os.listdir(local_dir)
    ck, start = open_tiers(copy, local_dir)
    assert (start.step, start.origin) == (5, "resumed from step 5")  # its persistent step
    err = capsys.readouterr().err
    assert f"warning: checkpoint.local_dir: {local_dir / original} belongs to the workdir " \
           f"{workdir} (this one is a copy of it): this copy starts a fresh local tier" in err
    save_steps(ck, range(6, 9))
    ck.close()
    mine = json.loads((copy / tiers.ID_FILE).read_text())["id"]
    assert mine != original and sorted(os.listdir(local_dir)) == sorted([original, mine])
    ck, start = open_tiers(workdir, local_dir)  # the original still resumes from its own
    assert (start.step, start.origin) == (8, "resumed from step 8 (local tier)")
    assert same(start.state, make_state(8, 8.0))
    ck.close()
    ck, start = open_tiers(copy, local_dir)  # and the copy from its own, silently
    assert (start.step, start.origin) == (8, "resumed from step 8 (local tier)")
    assert "warning" not in capsys.readouterr().err
    ck.close()
