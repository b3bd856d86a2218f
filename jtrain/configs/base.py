"""The reference run: a byte-level transformer LM on Python's own standard library.

    python -m jtrain.main --config=configs/base.py --workdir=runs/base
    python -m jtrain.main --config=configs/base.py:debug --workdir=runs/debug
    python -m jtrain.main --config=configs/base.py --workdir=runs/b2 --config.optim.lr=3e-4

No download: the corpus is a fixed list of stdlib modules (fingerprinted in summary.json).
Variants: `debug` (tiny, well under a minute on 2 CPU cores).
"""

from jtrain.config import defaults, variant_of

VARIANTS = ("", "debug")


def get_config(variant=None):
    variant = variant_of("configs/base.py", variant, VARIANTS)
    config = defaults(model="transformer")
    config.seed = 0
    config.total_steps = 1500

    config.model.d_model = 128
    config.model.num_layers = 4
    config.model.num_heads = 4
    config.model.d_ff = 512
    config.model.max_len = 128

    config.data.name = "pystdlib"
    config.data.seq_len = 128
    config.data.batch_size = 32

    config.optim.name = "adamw"
    config.optim.lr = 3e-3
    config.optim.schedule = "warmup_cosine"
    config.optim.warmup_steps = 100
    config.optim.weight_decay = 0.1
    config.optim.clip_norm = 1.0

    config.eval.every_steps = 500
    config.eval.num_batches = 20
    config.log.every_steps = 50
    config.checkpoint.every_steps = 500
    config.sample.prompts = ("def ", "import ", "class ")  # greedy, after the last eval
    config.sample.max_new_tokens = 24

    if variant == "debug":
        config.total_steps = 150
        config.model.d_model = 64
        config.model.num_layers = 2
        config.model.d_ff = 256
        config.model.max_len = 64
        config.data.seq_len = 64
        config.data.batch_size = 16
        config.optim.warmup_steps = 10
        config.eval.every_steps = 50
        config.eval.num_batches = 10
        config.log.every_steps = 10
        config.checkpoint.every_steps = 50
    return config
