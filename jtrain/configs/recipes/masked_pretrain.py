"""Recipe: masked pretraining of a set encoder (then configs/recipes/finetune.py).

    python -m jtrain.main --config=configs/recipes/masked_pretrain.py --workdir=runs/pretrain
    python -m jtrain.main --config=configs/recipes/masked_pretrain.py:debug --workdir=runs/pretrain

Demonstrates: a transformer encoder over token sets with padding and attention masks;
BERT-style masking (15 % of members, 80 % [MASK] / 10 % random / 10 % kept) drawn inside
the jitted step, keyed by the step; cross-entropy on the picked members only; eval
accuracy of the picked members (fixed picks per set). The data process is in
jtrain/recipes/tokensets.py. Variants: `debug` (fewer sets and steps).
"""

from jtrain.config import defaults, variant_of

VARIANTS = ("", "debug")


def get_config(variant=None):
    variant = variant_of("configs/recipes/masked_pretrain.py", variant, VARIANTS)
    config = defaults(model="user")
    config.model.factory = "jtrain.recipes.pretrain:make_pretrain_model"
    config.model.kwargs = {"width": 64, "layers": 2, "heads": 4}
    config.data.source = "jtrain.recipes.pretrain:make_pretrain_data"
    config.data.kwargs = {"n": 8192}
    config.data.batch_size = 64
    config.loss.fn = "jtrain.recipes.pretrain:mlm_loss"
    config.loss.eval_scope = "batch"
    config.eval.predict_fn = "jtrain.recipes.pretrain:mlm_predict"
    config.eval.metrics = ("loss", "accuracy")
    config.total_steps = 2000
    config.optim.lr = 2e-3
    config.optim.warmup_steps = 100
    config.optim.weight_decay = 0.01
    config.optim.clip_norm = 1.0
    config.eval.every_steps = 500
    config.log.every_steps = 100
    config.checkpoint.every_steps = 500
    if variant == "debug":
        config.data.kwargs = {"n": 4096}
        config.total_steps = 400
        config.eval.every_steps = 200
        config.log.every_steps = 50
        config.checkpoint.every_steps = 200
    return config
