"""A torch Dataset that draws from torch's global RNG in __getitem__ gets one warning line
per run, naming it and what to use instead, from a script and from the command line; one
that draws from its own torch.Generator gets none."""

from journey import run_python

DATASET = """\
import torch


class Noisy(torch.utils.data.Dataset):
    def __init__(self, own_generator=False):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(256, 4, generator=g)
        self.y = (self.x.sum(1) > 0).long()
        self.gen = torch.Generator().manual_seed(1) if own_generator else None

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        noise = torch.rand(4) if self.gen is None else torch.rand(4, generator=self.gen)
        return self.x[i] + 0.01 * noise, self.y[i]


def make(own_generator=False):
    return Noisy(own_generator)
"""
SCRIPT = """\
import sys

import jtrain
from noisy import Noisy

if __name__ == "__main__":
    config = {"total_steps": 3, "model": {"name": "mlp", "hidden": (8,), "num_outputs": 2},
              "data": {"batch_size": 16}, "eval": {"every_steps": 100, "num_batches": 1},
              "log": {"writers": ("jsonl",)}}
    for name in sys.argv[1:]:  # one run after the other, each after its own marker line
        print(f"== run {name}", file=sys.stderr, flush=True)
        own = name == "own"
        jtrain.train(config, f"runs/{name}", train_data=Noisy(own), eval_data=Noisy(own))
"""
CONFIG = """\
import ml_collections


def get_config():
    return ml_collections.ConfigDict({
        "total_steps": 3, "model": {"name": "mlp", "hidden": (8,), "num_outputs": 2},
        "data": {"batch_size": 16, "source": "noisy:make"},
        "eval": {"every_steps": 100, "num_batches": 1}, "log": {"writers": ("jsonl",)}})
"""


def rng_lines(proc):
    return [ln for ln in (proc.stdout + proc.stderr).splitlines() if "global RNG" in ln]


def test_global_rng_draws_get_one_warning_line(tmp_path):
    (tmp_path / "noisy.py").write_text(DATASET)
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "cfg.py").write_text(CONFIG)

    # One script, two runs: its own generator first (no line), then torch's global RNG
    # (one line), each run's output after its marker on stderr.
    proc = run_python(tmp_path, "train.py", "own", "global")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("global RNG") == 0
    before, marker, after = proc.stderr.partition("== run global\n")
    assert marker and "== run own\n" in before, proc.stderr[-3000:]
    assert [ln for ln in before.splitlines() if "global RNG" in ln] == []
    lines = [ln for ln in after.splitlines() if "global RNG" in ln]
    assert len(lines) == 1, lines
    assert lines[0].startswith("jtrain: warning: train_data (Noisy), eval_data (Noisy) draw "
                               "from torch's global RNG when an item is read")
    assert "jtrain.data.with_transform(dataset, fn(item, rng))" in lines[0]

    # The command line (data.source; eval held out of the same dataset): the same line,
    # on the console (not only in train.log).
    proc = run_python(tmp_path, "-m", "jtrain.main", "--config=cfg.py", "--workdir=runs/cli")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = rng_lines(proc)
    assert len(lines) == 1 and lines[0].startswith(
        "jtrain: warning: train_data (Noisy) draws from torch's global RNG"), lines
