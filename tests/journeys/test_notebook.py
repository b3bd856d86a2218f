"""examples/quickstart.ipynb in a real Jupyter kernel (nbclient + ipykernel), as a user runs
it: top to bottom; the training cell run twice (the second call says the run already
finished); a longer training cell interrupted (the kernel's SIGINT: a checkpoint of the
current step, the cell returns) and run again (it resumes from that step); progress
lines in the cell output without flooding it; no absl or signal errors anywhere."""

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
    long_cell = _cell(nb, "long_config")
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

        # A longer run, interrupted once its first log record is written.
        client.execute_cell(nbformat.v4.new_code_cell(
            "long_steps, long_workdir = 10**7, \"runs/interrupted\""), 0)
        metrics = tmp_path / "runs" / "interrupted" / "metrics.jsonl"
        _interrupt_when(client, lambda: len(_records(metrics)) >= 2)
        client.execute_cell(nb.cells[long_cell], long_cell)
        stopped = _text(nb.cells[long_cell])
        assert "stopped by SIGINT" in stopped and "checkpoint saved" in stopped, stopped
        summary = json.loads((metrics.parent / "summary.json").read_text())
        saved = summary["step"]
        assert summary["stopped_by"] == "SIGINT" and saved >= 1000
        assert f"step {saved} stopped by SIGINT" in stopped
        assert (metrics.parent / "checkpoints" / str(saved)).is_dir()

        # Run the cell again: it resumes from the saved step (interrupted again soon).
        _interrupt_when(client, lambda: _records(metrics)[-1]["step"] > saved)
        client.execute_cell(nb.cells[long_cell], long_cell)
        resumed = _text(nb.cells[long_cell])
        assert f"resumed from step {saved}" in resumed, resumed
        steps = [r["step"] for r in _records(metrics)]
        assert steps == sorted(steps) and steps[-1] > saved  # continued, not restarted
        assert json.loads((metrics.parent / "summary.json").read_text())["step"] > saved
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            text = out.get("text", "") + out.get("evalue", "")
            assert out.get("output_type") != "error", out
            assert not [b for b in BAD if b in text], text
