"""`--verify_topologies` from the command line, its negative control: with
determinism.topology_invariant off the same runs on 1 and 8 devices differ, and the
verifier says FAIL at the first step with exit 1 (its PASS is the example run on
docs/guide/determinism.md). A bad device list is one line and exit 2."""

from pathlib import Path

from journey import run_python, user_dir

REPO = Path(__file__).resolve().parents[2]

ARGS = ("-m", "jtrain.main", "--config=configs/base.py:debug", "--config.total_steps=2",
        "--config.eval.every_steps=0", "--config.checkpoint.every_steps=0")


def test_negative_control_fails_at_step_1(tmp_path):
    user_dir(tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "base.py").write_text((REPO / "configs" / "base.py").read_text())
    proc = run_python(tmp_path, *ARGS, "--workdir=v", "--verify_topologies=1,8",
                      "--verify_negative_control", timeout=900)
    line = [x for x in proc.stdout.splitlines() if "verify_topologies" in x]
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert line == ["jtrain: verify_topologies: FAIL: 8 devices differ from 1 device at "
                    "step 1: the state hash (opt_state, params) (negative control: "
                    "determinism.topology_invariant off)"]
    assert (tmp_path / "v" / "devices_1" / "hashes.jsonl").exists()
    bad = run_python(tmp_path, *ARGS, "--workdir=w", "--verify_topologies=2,x")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1] == (
        "jtrain: config error: --verify_topologies: device counts, e.g. 2,4,8; got 'x'")
