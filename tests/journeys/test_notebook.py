"""examples/quickstart.ipynb in a real Jupyter kernel (nbclient + ipykernel), as a user runs
it: top to bottom (a user's NNX model on a torch Dataset); the training cell run twice
(the second call says the run already finished); the run stopped halfway and resumed
ends with the uninterrupted run's state hash; a longer run interrupted (the kernel's
SIGINT: a checkpoint of the current step, the cell returns) and run again (it resumes
from that step); progress lines in the cell output without flooding it; no absl or
signal errors anywhere. The file is committed with its outputs, short."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import nbformat
from jupyter_core.utils import run_sync
from nbclient import NotebookClient

from journey import user_env

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "examples" / "quickstart.ipynb"
# A long run of the notebook's model and data, for the stop button (the kernel's SIGINT).
LONG_RUN = """long = jtrain.train({**config, "total_steps": 10**7, "log": {"every_steps": 200},
                     "eval": {"every_steps": 10**7}, "checkpoint": {"every_steps": 10**7}},
                    "runs/interrupted", model=Classifier, train_data=train_data,
                    eval_data=eval_data)
print("step", long.summary["step"], "stopped by", long.stopped_by)"""
BAD = ("Traceback", "UnparsedFlagAccessError", "signal only works in main thread",
       "KeyboardInterrupt", "internal error")


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream")


def _cell(nb, starts: str) -> int:
    return next(i for i, c in enumerate(nb.cells)
                if c.cell_type == "code" and c.source.startswith(starts))


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _interrupt_when(client, ready) -> threading.Thread:
    """Interrupts the kernel (as the stop button does) once `ready()` is true."""

    def wait():
        deadline = time.monotonic() + 120
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.05)
        run_sync(client.km.interrupt_kernel)()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


def test_quickstart_notebook_in_a_kernel(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, timeout=180, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    train_cell = _cell(nb, "result = jtrain.train(config")
    resume_cell = _cell(nb, "quiet = ")
    with client.setup_kernel(env=user_env()):
        for i, cell in enumerate(nb.cells):  # top to bottom, as "Run all"
            client.execute_cell(cell, i)
        first = _text(nb.cells[train_cell])
        assert "jtrain: done at step 120" in first and "step 120 eval accuracy" in first
        progress = [ln for ln in first.splitlines() if ln.startswith("step ") and "/" in ln]
        assert [ln.split("/")[0] for ln in progress] == [
            f"step {s}" for s in range(20, 140, 20)]  # one plain line per log step
        assert len(first.splitlines()) < 30 and len(first) < 6000  # no flood, no redraws
        assert "\r" not in first and "\x1b[" not in first
        assert any("image/png" in o.get("data", {}) for c in nb.cells
                   for o in c.get("outputs", []))  # the plot from metrics.jsonl
        evaluated = _text(nb.cells[_cell(nb, "report = evaluate_checkpoint")])
        assert evaluated.startswith("120 {")

        client.execute_cell(nb.cells[train_cell], train_cell)  # the same cell again
        again = _text(nb.cells[train_cell])
        assert "already finished at step 120" in again and "step 120 eval" in again
        assert not [ln for ln in again.splitlines() if ln.startswith("step ") and "/" in ln]

        # Stopped halfway and resumed: the uninterrupted run's state, bitwise (the
        # notebook asserts it too; an AssertionError there is an error output below).
        resumed = _text(nb.cells[resume_cell])
        assert "stopped at 60 by on_eval | resumed from 60 to 120" in resumed, resumed
        assert "= the uninterrupted run's" in resumed, resumed
        runs = tmp_path / "runs"
        hashes = {name: json.loads((runs / name / "summary.json").read_text())["state_sha256"]
                  for name in ("quickstart", "resumed")}
        assert hashes["resumed"] == hashes["quickstart"], hashes
        assert [r["step"] for r in _records(runs / "resumed" / "metrics.jsonl")
                if "train/loss" in r] == list(range(20, 140, 20))

        # A longer run, interrupted (the stop button) once its second log record is written.
        nb.cells.append(nbformat.v4.new_code_cell(LONG_RUN))
        long, long_index = nb.cells[-1], len(nb.cells) - 1
        metrics = runs / "interrupted" / "metrics.jsonl"
        _interrupt_when(client, lambda: len(_records(metrics)) >= 2)
        client.execute_cell(long, long_index)
        stopped = _text(long)
        assert "stopped by SIGINT" in stopped and "checkpoint saved" in stopped, stopped
        summary = json.loads((metrics.parent / "summary.json").read_text())
        saved = summary["step"]
        assert summary["stopped_by"] == "SIGINT" and saved >= 400
        assert f"step {saved} stopped by SIGINT" in stopped
        assert (metrics.parent / "checkpoints" / str(saved)).is_dir()

        # Run the cell again: it resumes from the saved step (interrupted again soon).
        _interrupt_when(client, lambda: _records(metrics)[-1]["step"] > saved)
        client.execute_cell(long, long_index)
        again = _text(long)
        assert f"resumed from step {saved}" in again, again
        steps = [r["step"] for r in _records(metrics)]
        assert steps == sorted(steps) and steps[-1] > saved  # continued, not restarted
        assert json.loads((metrics.parent / "summary.json").read_text())["step"] > saved
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            text = out.get("text", "") + out.get("evalue", "")
            assert out.get("output_type") != "error", out
            assert not [b for b in BAD if b in text], text


def test_the_notebook_is_committed_with_its_short_outputs():
    """What a reader sees before running anything: every code cell run once, top to bottom,
    its output kept (the plot, the resumed run's hash line), nothing failed, the file small."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1))
    assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs)
    assert "= the uninterrupted run's" in _text(nb.cells[_cell(nb, "quiet = ")])
    assert "jtrain: done at step 120" in _text(nb.cells[_cell(nb, "result = jtrain.train(")])
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    assert NOTEBOOK.stat().st_size < 100_000
    setup = next(c.source for c in nb.cells if c.source.startswith("## Set-up"))
    assert "pip install" in setup
