"""`python -m jtrain.bench peers` at a tiny size, run as a user runs it: the three sides
trained (losses fell), ran the same number of steps, and jtrain's eval metric is close to
plain PyTorch's on the same work. No wall-clock assertions (a shared CPU)."""

import json

import pytest

from jtrain.bench import main as bench_main
from jtrain.bench import peers as bp
from journey import run_python

pytestmark = pytest.mark.skipif(bool(bp.missing_peers()),
                                reason="the bench extra (lightning, scikit-learn) is missing")


def test_peers_tiny_run_trains_all_three_sides_alike(tmp_path, capsys):
    # One intra-op thread for the PyTorch sides: at this size their default pool (one
    # thread per core) spends more CPU spinning between ops than computing, over half of
    # each PyTorch side's CPU on a 2-core machine. The sides inherit this environment.
    proc = run_python(tmp_path, "-m", "jtrain.bench", "peers", "--cases=lm_tiny,mlp",
                      "--rounds=1", "--steps=20", "--out=peers.json", timeout=600,
                      OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "command: python -m jtrain.bench peers --cases=lm_tiny,mlp --rounds=1 --steps=20" \
        in proc.stdout
    res = json.loads((tmp_path / "peers.json").read_text())
    lm, mlp = res["cases"]
    for case in (lm, mlp):
        assert case["jtrain_command"] in proc.stdout
        for side in bp.SIDES:
            s = case["sides"][side]
            run = s["runs"][0]
            assert s["steps"] == [case["steps"]], (case["case"], side)
            assert run["evals"][-1][0] == case["steps"]  # the final eval at the same step
            assert run["last_loss"] < run["first_loss"], (case["case"], side)
            assert s["maxrss_mb"] > 50 and s["faults"] > 0 and s["wall_s"] > 0
            assert s["step_ms"] > 0 and s["time_to_target_s"] > 0  # numbers, not NaN
    j, t = (lm["sides"][x]["final_metric"] for x in ("jtrain", "torch"))
    assert abs(j - t) < 0.15 * t, (j, t)  # eval loss, same windows, different init draws
    j, t = (mlp["sides"][x]["final_metric"] for x in ("jtrain", "torch"))
    assert j > 0.5 and t > 0.5 and abs(j - t) < 0.15, (j, t)  # eval accuracy
    # The two PyTorch sides share model, init, order and optimizer: the same trajectory.
    assert lm["sides"]["torch"]["final_metric"] == pytest.approx(
        lm["sides"]["lightning"]["final_metric"], rel=1e-3)
    # What makes a number worth keeping: the machine, the commit, the load around each
    # side's run, each marked unreliable exactly when that load exceeded the cores.
    info = res["machine"]
    assert info["cores"] >= 1 and info["cpu_model"] and info["commit"] and info["date"]
    for case in (lm, mlp):
        for side in bp.SIDES:
            for run in case["sides"][side]["runs"]:
                load = run["load"]
                assert load["load_before"] >= 0 and load["load_max"] >= load["load_after"]
                assert run["unreliable"] == (load["load_max"] > info["cores"])
    # `table` in-process: its command's journey is docs/guide/benchmarking.md's example.
    capsys.readouterr()
    assert bench_main(["table", str(tmp_path / "peers.json")]) == 0
    table = capsys.readouterr().out
    assert table.count("| step ms | ") == 2 and info["commit"][:12] in table


def test_jtrain_side_reads_the_digits_without_torch(tmp_path):
    """The mlp case's jtrain side reads the digits as numpy arrays: torch (~180 MB of
    its process) is not imported there; the PyTorch sides wrap the same arrays."""
    assert 'config.data.source = "jtrain.bench.digits:digits"' in bp.MLP_CONFIG
    code = ("import sys; from jtrain.bench import digits; d = digits.digits(); "
            "print(len(d['train'][0]), len(d['eval'][0]), 'torch' in sys.modules)")
    proc = run_python(tmp_path, "-c", code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["1500", "297", "False"]
    import runpy

    import numpy as np

    peer = runpy.run_path(str(bp.PEER_SCRIPT))  # not as __main__: defines, runs nothing
    from jtrain.bench import digits

    for split in ("train", "eval"):
        ds, (x, y) = peer["Digits"](split), digits.arrays(split)
        assert np.array_equal(ds.x.numpy(), x) and np.array_equal(ds.y.numpy(), y)


def test_missing_peers_is_one_line_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(bp, "missing_peers", lambda: ["lightning"])
    assert bench_main(["peers"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "jtrain: usage error: peers needs lightning (pip install 'jtrain[bench]')\n"


def test_bad_case_is_one_line_exit_2(capsys):
    assert bench_main(["peers", "--cases=lm_huge"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lm_huge" in err


def test_blocks_drop_warmup_and_the_interval_after_an_eval():
    stamps = [(5, 1.0), (10, 1.5), (15, 2.0), (20, 9.0), (25, 9.5)]
    # (5,10] and (10,15] kept; (15,20] follows the eval at 15: dropped; (20,25] kept.
    assert bp._blocks(stamps, 5, {15}) == pytest.approx([100.0, 100.0, 100.0])
