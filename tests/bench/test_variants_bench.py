"""`python -m jtrain.bench variants` as a user runs it: GPT-2 small's debug size in bf16
and bf16 + fp8 on one CPU device for 2 steps: the table with ratios, and the MFU line,
which on a CPU says "unknown peak" and gives no MFU; with a known peak the MFU is the
model FLOPs over the step time and the peak."""

import json

import pytest

from jtrain.bench import main as bench_main
from jtrain.bench import variants
from jtrain.observe import compiles
from journey import run_python


def test_gpt2_debug_bf16_and_fp8_print_the_mfu_line_without_a_false_number(tmp_path):
    # The bench times steps, not compiles, and its devices' process turns on no compile
    # cache: JAX's own cache variables point it at jtrain's, so that a warm cache skips
    # the two variants' compiles (over half of this test's CPU). The figures and the
    # memory column read the same from a cached program.
    p = run_python(tmp_path, "-m", "jtrain.bench", "variants", "--base=gpt2_small:debug",
                   "--devices=1", "--variants=bf16,bf16_fp8", "--steps=2", "--rounds=1",
                   "--out=res.json", JAX_COMPILATION_CACHE_DIR=compiles.cache_path("auto"),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert any(line.split()[:1] == ["bf16_fp8"] and line.endswith("x") for line in lines)
    for side in ("bf16", "bf16_fp8"):
        mfu = next(line for line in lines if line.startswith(f"{side}: "))
        assert "tokens/s, model FLOPs per step" in mfu
        assert mfu.endswith("unknown peak (cpu): no MFU")
    res = json.loads((tmp_path / "res.json").read_text())
    assert res["peak_flops"] is None and set(res["memory"]) == {"bf16", "bf16_fp8"}
    assert res["flops_per_step"]["bf16"] == res["flops_per_step"]["bf16_fp8"] > 0


def test_the_mfu_of_a_known_peak():
    res = {"median": {"bf16": {"wall_ms": 500.0}}, "flops_per_step": {"bf16": 4e14},
           "tokens_per_step": {"bf16": 32768}, "peak_flops": 1e15, "devices": 2,
           "device_kind": "NVIDIA H100 80GB HBM3"}
    assert variants.mfu_line(res, "bf16") == (
        "bf16: 65,536 tokens/s, model FLOPs per step 4.000e+14; MFU 40.0% (peak 1000 "
        "TFLOP/s per device, NVIDIA H100 80GB HBM3)")


@pytest.mark.parametrize("arg", ["--variants=plain,fp16", "--steps=0"])
def test_bad_arguments_are_one_line_exit_2(capsys, arg):
    assert bench_main(["variants", arg]) == 2
    out, err = capsys.readouterr()
    assert len((out + err).strip().splitlines()) == 1
