"""Writes never follow a link out of the run: a whole file jtrain writes (config.json,
run.json, summary.json, export.json, ...) replaces a symlink at its path instead of writing
through it; a file jtrain appends to (metrics.jsonl, train.log, hashes.jsonl,
skipped.jsonl) that is a symlink is one line; `jtrain export --out` refuses the run's own
workdir, a folder inside it and a folder holding another run."""

from __future__ import annotations

import os

import numpy as np
import pytest
from flax import nnx

import jtrain
from jtrain.checkpoint import export as export_lib
from jtrain.errors import UsageError, WorkdirError, exit_code, render
from jtrain.observe import layout


class Net(nnx.Module):
    def __init__(self, rngs):
        self.out = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(x)


def _train(workdir, steps: int):
    x = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
    cfg = {"total_steps": steps, "data": {"batch_size": 8},
           "checkpoint": {"every_steps": 2},
           "log": {"verbosity": 0, "writers": ["jsonl"]}}
    return jtrain.train(cfg, str(workdir), model=Net(nnx.Rngs(0)),
                        train_data=(x, (x[:, 0] > 0).astype(np.int32)),
                        allow_changes=["total_steps"])


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("safe") / "run"
    _train(workdir, 2)
    return workdir


def test_resume_replaces_links_and_leaves_their_targets(run_dir, tmp_path):
    outside = {name: tmp_path / f"outside_{name}" for name in
               ("config.json", "run.json", "summary.json")}
    for name, target in outside.items():
        target.write_bytes((run_dir / name).read_bytes())
        (run_dir / name).unlink()
        (run_dir / name).symlink_to(target)
    before = {name: t.read_bytes() for name, t in outside.items()}
    _train(run_dir, 4)  # resumes at step 2, rewrites all three
    assert {name: t.read_bytes() for name, t in outside.items()} == before
    for name in outside:
        assert not (run_dir / name).is_symlink() and (run_dir / name).is_file()
    assert b'"total_steps": 4' in (run_dir / "config.json").read_bytes()
    assert not [n for n in os.listdir(run_dir) if n.endswith(".tmp")]


@pytest.mark.parametrize("name", ["metrics.jsonl", "train.log"])
def test_an_appended_file_that_is_a_link_is_one_line(run_dir, tmp_path, name):
    target = tmp_path / "outside"
    target.write_bytes((run_dir / name).read_bytes())
    saved = run_dir / f"{name}.saved"
    os.rename(run_dir / name, saved)
    (run_dir / name).symlink_to(target)
    try:
        with pytest.raises(WorkdirError) as raised:
            _train(run_dir, 6)
    finally:
        (run_dir / name).unlink()
        os.rename(saved, run_dir / name)
    assert f"{name}: is a symlink" in render(raised.value) and exit_code(raised.value) == 2
    assert target.read_bytes() == saved.parent.joinpath(name).read_bytes()


def test_open_append_and_write_file(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(WorkdirError, match="not a regular file"):
        layout.open_append(str(tmp_path / "fifo"))  # never blocks
    (tmp_path / "tmp-link").symlink_to(tmp_path / "victim")
    layout.write_file(str(tmp_path / "tmp-link"), "x")
    assert not (tmp_path / "victim").exists() and (tmp_path / "tmp-link").read_text() == "x"
    with layout.open_append(str(tmp_path / "log")) as f:
        f.write("a\n")
    assert (tmp_path / "log").read_text() == "a\n"


def test_export_out_refuses_the_run_and_other_runs(run_dir, tmp_path):
    for out in (run_dir, run_dir / "checkpoints", run_dir / "exports" / "x"):
        with pytest.raises(UsageError, match="inside the run's workdir"):
            export_lib.export(str(run_dir), str(out))
    os.symlink(run_dir, tmp_path / "alias")  # the same folder by another name
    with pytest.raises(UsageError, match="inside the run's workdir"):
        export_lib.export(str(run_dir), str(tmp_path / "alias"))
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    with pytest.raises(UsageError, match="holds a run"):
        export_lib.export(str(run_dir), str(other))
    assert not (run_dir / "exports").exists()
    record = export_lib.export(str(run_dir), str(tmp_path / "ok"))
    assert record["step"] >= 2 and (tmp_path / "ok" / "export.json").is_file()
