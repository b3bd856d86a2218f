"""A user mixes a table (arrays) with a sensor stream (a torch IterableDataset of their
own, no len) from a config file on the command line; the run is killed and resumed
(--verify_resume) and ends bitwise identical; the header says the component is a
stream, and the end-of-run line and summary.json give its draws and completed passes."""

import json

from journey import verify_resume

CONFIG = '''
import ml_collections


def get_config(arg=None):
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.total_steps = 6
    c.model = dict(name="mlp", num_outputs=2, hidden=(8,))
    c.data = dict(batch_size=8, val_fraction=0.0,
                  mixture={"table": {"source": "mydata:table", "weight": 0.6},
                           "sensor": {"source": "mydata:sensor", "weight": 0.4}})
    c.checkpoint = dict(every_steps=1, async_save=False)  # a step kill resumes from a save
    return c
'''

DATA = '''
import numpy as np
import torch


def table(n=64):
    r = np.random.default_rng(0)
    y = r.integers(0, 2, n).astype(np.int32)
    return {"inputs": (r.normal(size=(n, 4)) + y[:, None]).astype(np.float32), "targets": y}


class Sensor(torch.utils.data.IterableDataset):  # a stream: no len, read in order
    def __iter__(self):
        r = np.random.default_rng(1)
        for _ in range(7):
            y = np.int32(r.integers(0, 2))
            yield {"inputs": (r.normal(size=4) - y).astype(np.float32), "targets": y}


def sensor():
    return Sensor()
'''


def test_cli_mixture_with_a_stream_component_resumes_bitwise(tmp_path):
    (tmp_path / "cfg.py").write_text(CONFIG)
    (tmp_path / "mydata.py").write_text(DATA)
    proc, lines = verify_resume(tmp_path, "cfg.py", "runs/m", kills=1)
    assert proc.returncode == 0 and len(lines) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert lines[0].startswith("jtrain: verify_resume: PASS: bitwise identical"), lines[0]
    run = tmp_path / "runs" / "m" / "reference"
    log = (run / "train.log").read_text()
    assert "sensor (0.40, stream)" in log and "table (0.60, 64 examples)" in log, log[:3000]
    assert "read whole and in order by every process" in log
    block = json.loads((run / "summary.json").read_text())["data"]["mixture"]["sensor"]
    assert block["size"] == "stream" and block["draws"] > 7, block
    assert block["epochs"] == (block["draws"] - 1) // 7  # passes whose end was read
    assert f"sensor {block['draws']} drawn ({block['epochs']} epochs)" in log
