"""A user mixes two data.source functions (variable-length token documents) by weight,
with a schedule and first-fit packing, from a config file on the command line; the run
is SIGKILLed and restarted by jtrain's resume verifier and ends bitwise identical to
the same config trained straight through (in the test's process); the header names the
components and the packing, and each component's eval set is scored on its own."""

import json
import runpy

from journey import killed_and_restarted

CONFIG = '''
import ml_collections


def get_config(arg=None):
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.total_steps = 10
    c.model = dict(vocab_size=64, d_model=32, num_layers=1, num_heads=2, d_ff=64,
                   max_len=32)
    c.data = dict(batch_size=4, seq_len=32, packing="first_fit", val_fraction=0.1,
                  mixture={"genes": {"source": "docs:make", "kwargs": {"seed": 1},
                                     "weight": 0.7},
                           "proteins": {"source": "docs:make",
                                        "kwargs": {"seed": 2, "offset": 32},
                                        "weight": 0.3}},
                  mixture_schedule={4: {"genes": 0.2, "proteins": 0.8}})
    c.eval = dict(every_steps=4)
    c.checkpoint = dict(every_steps=2, async_save=False)  # one kill lands after a save
    return c
'''

DOCS = '''
import numpy as np


def make(seed=0, offset=0, n=120):
    r = np.random.default_rng(seed)
    return [(r.integers(0, 32, r.integers(3, 40)) + offset).astype(np.int32)
            for _ in range(n)]
'''


def test_cli_mixture_with_packing_resumes_bitwise(tmp_path):
    (tmp_path / "cfg.py").write_text(CONFIG)
    (tmp_path / "docs.py").write_text(DOCS)
    config = runpy.run_path(str(tmp_path / "cfg.py"))["get_config"]()
    run = killed_and_restarted(tmp_path, config, ["-m", "jtrain.main", "--config=cfg.py"],
                               "runs/m", modules=("docs",))
    log = (run / "train.log").read_text()
    assert "mixture of 2: genes (0.70" in log and "proteins (0.30" in log, log[:3000]
    assert "packed (first_fit): 120 documents" in log
    assert "weights change at steps 4" in log
    assert json.loads((run / "config.json").read_text())["data"]["model_inputs"] == [
        "inputs", "segment_ids", "positions"]
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"eval/loss", "eval/genes/loss", "eval/proteins/loss"} <= set(last), last
