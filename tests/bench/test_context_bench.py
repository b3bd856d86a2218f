"""`python -m jtrain.bench context`: bad flags are one line and exit 2 before any
process starts; the report puts both sides and their ratios side by side."""

from jtrain.bench import context as bc
from jtrain.bench import main as bench_main


def test_bad_flags_are_one_line(capsys):
    assert bench_main(["context", "--context=3", "--seq_len=64"]) == 2
    out, err = capsys.readouterr()
    assert (out + err).strip().splitlines() == [
        "jtrain: usage error: --context >= 2 dividing --seq_len, --steps >= 1"]


def test_the_report_sets_the_sides_side_by_side():
    res = {"context": 4, "seq_len": 1024, "steps": 10, "note": bc.NOTE, "load_before": 1.0,
           "load_after": 2.0, "plain": {"step_ms": 100.0, "peak_bytes": 200 * 2**20},
           "split": {"step_ms": 250.0, "peak_bytes": 50 * 2**20}, "step_ratio": 2.5,
           "memory_ratio": 0.25}
    lines = bc.format_report(res).splitlines()
    assert lines[3].split() == ["step", "time", "(ms)", "100.0", "250.0", "2.50"]
    assert lines[4].split() == ["peak", "memory/device", "(MiB)", "200.00", "50.00", "0.25"]
    assert lines[5] == "load average 1.0 before, 2.0 after"
