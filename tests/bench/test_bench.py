"""`python -m jtrain.bench`: the overhead bench's output and JSON structure on a tiny run,
the steady-state arithmetic, and the not-yet-implemented subcommands. No wall-clock
assertions: timings on a shared CPU are noise."""

import json
import math
import re

import numpy as np
import pytest

from journey import run_python
from jtrain.bench import main as bench_main
from jtrain.bench import command as bench
from jtrain.observe import compiles


def _positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_future_subcommands_exit_2_with_one_line(capsys):
    # A loop, not a parametrize: with no subcommand left unimplemented (today) an empty
    # parametrize would be a skip, and a skip fails the suite.
    for name in bench.NOT_IMPLEMENTED:
        assert bench_main([name]) == 2
        out, err = capsys.readouterr()
        assert out == ""
        assert err == f"jtrain: usage error: '{name}' is not implemented yet\n"


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        bench_main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in ("overhead", "data", "checkpoint", "console", "scaling"):
        assert name in out


def test_steady_state_drops_the_first_interval():
    from jtrain.bench import overhead as bo

    logs = [  # steps 10 (compile: 5 s), 20, 30; 0.1 s per 10 steps after it
        {"step": 10, "time": 105.0, "perf/steps_per_sec": 2.0, "train/loss": 3.0},
        {"step": 20, "time": 105.1, "perf/steps_per_sec": 100.0, "train/loss": 2.5},
        {"step": 30, "time": 105.2, "perf/steps_per_sec": 100.0, "train/loss": 2.0},
    ]
    s = bo.jtrain_sample(logs, log_every=10, total=30, wall=107.0)
    assert s.ms_per_step == pytest.approx(10.0)
    assert s.intervals_ms == pytest.approx([10.0, 10.0])
    assert s.final_loss == 2.0
    assert s.fixed_s == pytest.approx(106.8)
    with pytest.raises(RuntimeError, match="lacks the log records"):
        bo.jtrain_sample(logs[:1], log_every=10, total=30, wall=1.0)


def test_rounds_alternate_which_side_runs_first(monkeypatch):
    """Each side runs first in every other round, and each round's ratio pairs that
    round's two samples."""
    from jtrain.bench import overhead as bo

    calls = []

    def sample(ms):
        return bo.Sample(ms_per_step=ms, final_loss=1.0, fixed_s=1.0, intervals_ms=[ms])

    class Hand:
        def __init__(self, cfg):
            pass

        def run(self, steps, log_every):
            calls.append("hand")
            return sample(10.0)

    def run_jtrain(cfg, root, r, keep):
        calls.append("jtrain")
        return sample(11.0 + r)

    monkeypatch.setattr(bo, "HandLoop", Hand)
    monkeypatch.setattr(bo, "run_jtrain", run_jtrain)
    monkeypatch.setattr(bo.jax, "device_count", lambda: 1)
    res = bo.run_overhead("tiny", rounds=3, steps=2, log_every=1, workdir=None,
                          progress=lambda line: None)
    assert calls == ["jtrain", "hand", "hand", "jtrain", "jtrain", "hand"]
    assert res["paired_ratios"] == pytest.approx([1.1, 1.2, 1.3])
    assert "final loss: the same to the bit on both sides in every round" in \
        bench.format_report(res).splitlines()
    res["hand"]["final_loss"][1] = float(np.nextafter(np.float32(1.0), np.float32(2.0)))
    assert "final loss: differs in 1 rounds" in bench.format_report(res).splitlines()


# The hand-written loop (jtrain.bench.overhead.HandLoop) turns on no compile cache of
# its own: JAX's cache variables point it at jtrain's, so that with a warm cache its
# compiles are skipped. The benches time steady-state steps, never these compiles.
HAND_CACHE = {"JAX_COMPILATION_CACHE_DIR": compiles.cache_path("auto"),
              "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def test_overhead_tiny_run(tmp_path):
    """As a user runs it: from an empty directory, a relative --out, one device."""
    out = tmp_path / "res.json"
    proc = run_python(tmp_path, "-m", "jtrain.bench", "overhead", "--model=tiny", "--rounds=1",
                      "--steps=20", "--log_every=10", "--out=res.json", timeout=600,
                      **HAND_CACHE)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"overhead tiny: jtrain (\S+) ms/step, hand (\S+) ms/step, "
                     r"ratio (\S+) \(goal <= 1\.1\)", last)
    assert m, last
    assert all(_positive(float(g)) for g in m.groups())
    assert "MFU: n/a on cpu" in proc.stdout

    res = json.loads(out.read_text())
    assert _positive(res["ratio"])
    assert res["ratio"] == pytest.approx(float(m.group(3)), abs=5e-4)  # printed to 3 places
    assert (res["model"], res["rounds"], res["steps"], res["log_every"]) == ("tiny", 1, 20, 10)
    for side in ("jtrain", "hand"):
        r = res[side]
        assert len(r["ms_per_step"]) == 1
        assert all(_positive(r[k]) for k in ("median_ms", "min_ms", "max_ms", "tokens_per_sec"))
        assert r["mfu"] is None
    assert len(res["jtrain"]["intervals_ms"][0]) == 2  # steps 20 and 30; step 10 dropped
    assert res["jtrain"]["fixed_s"][0] > 0
    # Same init, batches and optimizer: both sides trained the same trajectory.
    assert res["jtrain"]["final_loss"][0] == pytest.approx(res["hand"]["final_loss"][0],
                                                           rel=1e-3)


def test_console_bench_reports_both_sides(tmp_path, capsys):
    """`python -m jtrain.bench console`: one row per round, the medians and a positive
    ratio, the JSON beside it; no timing asserted."""
    out = tmp_path / "console.json"
    assert bench_main(["console", "--updates=30", "--rounds=2", "--columns=80",
                       f"--out={out}"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "console: 2 rounds x 30 updates, terminal 80 columns"
    assert len(lines) == 5 and re.match(r"console: rich bar \d+ us/update, plain line \d+ "
                                        r"us/update \(medians\), ratio [\d.]+;", lines[-1])
    res = json.loads(out.read_text())
    assert len(res["rich_us"]) == len(res["plain_us"]) == 2 and _positive(res["ratio"])
    assert bench_main(["console", "--columns=5"]) == 2


def test_tokens_bench_reports_reader_and_step_side_by_side(tmp_path):
    """`python -m jtrain.bench tokens` from an empty directory: a row per round, both
    sides' tokens/s, the ratio of the medians, the JSON beside it; no timing asserted."""
    proc = run_python(tmp_path, "-m", "jtrain.bench", "tokens", "--model=tiny",
                      "--tokens=20000", "--shard_tokens=5000", "--batches=5", "--steps=2",
                      "--rounds=2", "--out=tok.json", timeout=600, **HAND_CACHE)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((tmp_path / "tok.json").read_text())
    assert len(res["rounds"]) == 2 and (res["batch_size"], res["seq_len"]) == (8, 32)
    assert all(_positive(r[s]) for r in res["rounds"] for s in ("reader", "step"))
    assert res["reader_vs_step"] == pytest.approx(res["median"]["reader"] /
                                                  res["median"]["step"])
    assert f"reader / step = {res['reader_vs_step']:.1f}x" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok.json"]  # shards: a temp dir
