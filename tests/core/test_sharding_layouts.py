"""FSDP and tensor parallelism on 8 fake devices, in one user script: the per-device
shape of every parameter and of both Adam moments for fsdp=8, tensor=2 x fsdp=4 and
data=2 x fsdp=2 x tensor=2, and the same losses as plain data parallelism (1e-6)."""

import json

from journey import run_python

SCRIPT = '''
import json
import jax
import jtrain

def config(**mesh):
    c = jtrain.defaults()
    c.total_steps = 4
    c.model.update(d_model=32, num_layers=1, num_heads=4, d_ff=64, max_len=32)
    c.data.update(seq_len=32, batch_size=16)
    c.optim.update(warmup_steps=1)
    c.eval.update(every_steps=0, num_batches=2)
    c.log.update(every_steps=1, writers=("jsonl",))
    c.checkpoint.every_steps = 0
    c.mesh.update({"data": 1, "fsdp": 1, "tensor": 1, **mesh})
    return c

out = {}
for name, mesh in [("dp", dict(data=8)), ("fsdp8", dict(fsdp=8)),
                   ("tp2_fsdp4", dict(tensor=2, fsdp=4)),
                   ("dp2_fsdp2_tp2", dict(data=2, fsdp=2, tensor=2))]:
    r = jtrain.train(config(**mesh), "runs/" + name)
    leaves = {}
    for part in ("params", "opt_state"):
        for path, x in jax.tree_util.tree_flatten_with_path(getattr(r.state, part))[0]:
            if getattr(x, "ndim", 0) >= 1:
                leaves[part + jax.tree_util.keystr(path)] = list(x.sharding.shard_shape(x.shape))
    out[name] = {"losses": [h["train/loss"] for h in r.train_history],
                 "eval": r.summary["eval/loss"], "shards": leaves}
print("RESULT " + json.dumps(out))
'''

# (per-device shape of the parameter, of each of its two Adam moments), per layout
EXPECTED = {
    "fsdp8": {"['embed']['embedding']": [256, 4],          # [V, D]: D on fsdp
              "['layer_0']['attn']['query']": [4, 4, 8],   # [D, H, K]: D on fsdp
              "['layer_0']['mlp']['wi']": [4, 64],         # [D, F]
              "['layer_0']['mlp']['wo']": [64, 4],         # [F, D]
              "['final_norm']['scale']": [32]},            # replicated
    "tp2_fsdp4": {"['embed']['embedding']": [128, 8],      # V on tensor, D on fsdp
                  "['layer_0']['attn']['query']": [8, 2, 8],  # H on tensor
                  "['layer_0']['attn']['out']": [2, 8, 8],    # [H, K, D]
                  "['layer_0']['mlp']['wi']": [8, 32],
                  "['layer_0']['mlp']['wo']": [32, 8],
                  "['final_norm']['scale']": [32]},
    "dp2_fsdp2_tp2": {"['embed']['embedding']": [128, 16],
                      "['layer_0']['attn']['query']": [16, 2, 8],
                      "['layer_0']['mlp']['wi']": [16, 32],
                      "['final_norm']['scale']": [32]},
}


def test_fsdp_and_tensor_parallel_shard_shapes_and_losses(tmp_path):
    (tmp_path / "layouts.py").write_text(SCRIPT)
    p = run_python(tmp_path, "layouts.py",
                   XLA_FLAGS="--xla_force_host_platform_device_count=8")
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.split("RESULT ", 1)[1])
    for layout, leaves in EXPECTED.items():
        shards = out[layout]["shards"]
        for leaf, shape in leaves.items():
            assert shards["params" + leaf] == shape, (layout, leaf)
            moments = [v for k, v in shards.items()
                       if k.startswith("opt_state") and k.endswith(leaf)]
            assert moments == [shape, shape], (layout, leaf, moments)  # mu and nu
        dp = out["dp"]
        assert len(out[layout]["losses"]) == len(dp["losses"]) == 4
        for a, b in zip(out[layout]["losses"] + [out[layout]["eval"]],
                        dp["losses"] + [dp["eval"]], strict=True):
            assert abs(a - b) <= 1e-6 * max(1.0, abs(b)), (layout, a, b)
    assert out["dp"]["shards"]["params['embed']['embedding']"] == [256, 32]
