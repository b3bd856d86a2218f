"""`python -m jtrain.bench data` on a tiny setting: the report's lines and the JSON's
numbers (no wall-clock assertions: timings on a shared CPU are noise)."""

import json
import math
import re

from jtrain.bench import main as bench_main


def test_data_bench_reports_medians_and_ratios(tmp_path, capsys):
    out = tmp_path / "data.json"
    code = bench_main(["data", "--num_examples=160", "--batch_size=16", "--rounds=1",
                       "--batches=4", "--steps=3", f"--out={out}"])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.match(r"\(a\) examples/s: jtrain [\d,]+, torch DataLoader [\d,]+, ratio [\d.]+ "
                    r"\(goal >= 1\.0\)$", lines[-3]), lines[-3]
    assert re.match(r"\(b\) step time: real data [\d.]+ ms, synthetic on-device batch [\d.]+ "
                    r"ms, ratio [\d.]+ \(goal <= 1\.03\)$", lines[-2]), lines[-2]
    assert lines[-1].startswith("(c) time to first batch: jtrain ")
    res = json.loads(out.read_text())
    assert len(res["rows"]) == 1 and res["batch_size"] == 16
    for key, value in res["median"].items():
        assert math.isfinite(value) and value > 0, key
    assert res["examples_ratio"] > 0 and res["step_ratio"] > 0


def test_data_bench_refuses_bad_sizes(capsys):
    assert bench_main(["data", "--num_examples=10", "--batch_size=16"]) == 2
    assert capsys.readouterr().err.startswith("jtrain: usage error: sizes must be")
