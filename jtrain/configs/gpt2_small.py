"""GPT-2 small (124 M parameters) on the built-in byte corpus: the GPU throughput run.

    python -m jtrain.main --config=configs/gpt2_small.py --workdir=runs/gpt2
    python -m jtrain.bench variants --base=gpt2_small --devices=1 --variants=bf16,bf16_fp8
    python -m jtrain.main --config=configs/gpt2_small.py:debug --workdir=runs/gpt2_dbg

The shape of GPT-2 small (Radford et al. 2019): 12 layers, d_model 768, 12 heads, MLP 3072,
sequence 1024, tied embeddings over a 50,304-entry table (GPT-2's 50,257 rounded up to a
multiple of 64, as nanoGPT does). The corpus is jtrain's byte-level stdlib text, so only ids
< 256 occur; the full table is kept so that the parameter count (124 M) and the FLOPs per
token match GPT-2 small. bf16 compute (model.dtype=auto on a GPU), float32 parameters and
optimizer state, cuDNN fused attention (model.attention=auto on a GPU).
Variants: `debug` (2 layers, d_model 64, sequence 128: a few CPU seconds per step).
"""

from jtrain.config import defaults, variant_of

VARIANTS = ("", "debug")


def get_config(variant=None):
    variant = variant_of("configs/gpt2_small.py", variant, VARIANTS)
    config = defaults(model="transformer")
    config.seed = 0
    config.total_steps = 2000

    config.model.vocab_size = 50304
    config.model.d_model = 768
    config.model.num_layers = 12
    config.model.num_heads = 12
    config.model.d_ff = 3072
    config.model.max_len = 1024

    config.data.name = "pystdlib"
    config.data.seq_len = 1024
    config.data.batch_size = 32

    config.optim.name = "adamw"
    config.optim.lr = 6e-4
    config.optim.b2 = 0.95
    config.optim.schedule = "warmup_cosine"
    config.optim.warmup_steps = 100
    config.optim.weight_decay = 0.1
    config.optim.clip_norm = 1.0

    config.eval.every_steps = 1000
    config.eval.num_batches = 8
    config.log.every_steps = 20
    config.checkpoint.every_steps = 1000

    if variant == "debug":
        config.total_steps = 20
        config.model.d_model = 64
        config.model.num_layers = 2
        config.model.num_heads = 2
        config.model.d_ff = 256
        config.model.max_len = 128
        config.data.seq_len = 128
        config.data.batch_size = 4
        config.optim.warmup_steps = 5
        config.eval.every_steps = 20
        config.eval.num_batches = 2
        config.log.every_steps = 5
        config.checkpoint.every_steps = 20
    return config
