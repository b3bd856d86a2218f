"""`python -m jtrain.bench profile`: the per-op profile of the train step. The parser's
matmul FLOPs must equal the model's analytic count (a wrong HLO parse cannot pass), and
the run goes as a user types it. No wall-clock assertions."""

import json

import pytest

from journey import run_python


def test_profile_tiny_run_counts_the_models_flops(tmp_path):
    # docs/guide/benchmarking.md's example, as pasted (its block names this test):
    # python -m jtrain.bench profile --model=tiny --steps=2 --top=5 --out=profile.json
    proc = run_python(tmp_path, "-m", "jtrain.bench", "profile", "--model=tiny", "--steps=2",
                      "--top=5", "--out=profile.json", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("profile tiny: 2 steps, wall ")
    res = json.loads((tmp_path / "profile.json").read_text())

    from jtrain.bench import overhead
    from jtrain.models import transformer

    cfg = overhead.bench_config("tiny", 2, 3)
    analytic = transformer.flops_per_example(cfg.model, (cfg.data.seq_len,)) \
        * cfg.data.batch_size
    assert res["matmul_gflop"] == pytest.approx(analytic / 1e9, rel=0.01, abs=0.005)
    assert res["groups"]["matmul"] > 0 and res["op_ms"] > 0 and res["wall_ms"] > 0
    ranked = [r["ms"] for r in res["ops"]]
    assert ranked == sorted(ranked, reverse=True) and len(ranked) > 5
    assert {r["group"] for r in res["ops"]} <= {"matmul", "elementwise", "copy/transpose"}
    assert res["scratch_mib"] > 0 and "xla_cpu_enable_xprof_traceme=true" in res["xla_flags"]
    assert len(proc.stdout.splitlines()) == 2 + len(res["groups"]) + 1 + 5 + 2


def test_hlo_parse_of_a_known_program():
    import jax
    import jax.numpy as jnp

    from jtrain.bench import profile

    def f(x, w, q):  # a dot [64,32]x[32,16], a batched dot, a transpose copy
        return x @ w, jnp.einsum("bqd,bkd->bqk", q, q), (x * 2).T.copy()

    args = (jnp.ones((64, 32)), jnp.ones((32, 16)), jnp.ones((4, 8, 6)))
    ops = profile.hlo_ops(jax.jit(f).lower(*args).compile().as_text())
    flops = sorted(op["flops"] for op in ops.values() if op["flops"])
    assert flops == sorted([2 * 64 * 16 * 32, 2 * 4 * 8 * 8 * 6])
