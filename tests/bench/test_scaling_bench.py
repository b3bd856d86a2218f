"""`python -m jtrain.bench scaling` at a tiny size, as a user runs it: the table, the
note that fake devices measure overhead, the time-to-first-step lines and the JSON."""

import json
import math

from jtrain.bench import main as bench_main
from jtrain.observe import compiles
from journey import run_python


def test_scaling_bench_tiny_run(tmp_path):
    # JAX's own cache variables give the hand-written loop's process (no jtrain, so no
    # cache of its own) jtrain's warm cache: its compiles, over a third of this test's
    # CPU, are skipped. The jtrain runs set their cache themselves: the cold one still
    # compiles everything (asserted below), the warm one reads what the cold one wrote.
    p = run_python(tmp_path, "-m", "jtrain.bench", "scaling", "--model=tiny", "--devices=2",
                   "--strategies=fsdp,tensor", "--steps=2", "--out=res.json",
                   JAX_COMPILATION_CACHE_DIR=compiles.cache_path("auto"),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    assert "measure the overhead of sharding, not a speed-up" in out
    assert "time to first step: hand-written jax.jit loop" in out and "x cold" in out
    res = json.loads((tmp_path / "res.json").read_text())
    rates = res["rates"]["2"]
    assert set(rates) == {"fsdp", "tensor"}
    assert all(math.isfinite(v) and v > 0 for v in rates.values())
    # The warm run found every compile of the cold run in the cache.
    assert res["cold"]["compile/cache_hits"] == 0
    assert res["warm"]["compile/cache_hits"] == res["warm"]["compile/count"] > 0
    for mode in ("hand", "cold", "warm"):
        assert res[mode]["time_to_first_step_sec"] > 0


def test_bad_devices_is_one_line_exit_2(capsys):
    assert bench_main(["scaling", "--devices=0"]) == 2  # in-process: fails before any run
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "devices" in err
