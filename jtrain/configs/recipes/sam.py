"""Recipe: sharpness-aware minimisation (SAM) as a step of your own.

    python -m jtrain.main --config=configs/recipes/sam.py --workdir=runs/sam
    python -m jtrain.main --config=configs/recipes/sam.py:debug --workdir=runs/sam_dbg
    python -m jtrain.bench sam          # its step time against the built-in AdamW update

Demonstrates: `step.factory` (jtrain/recipes/sam.py) with two gradient evaluations per
update (at w, then at the ascent point w + rho * g / ||g||, the AdamW update applied at w
with the second gradient) on scikit-learn's breast-cancer table, with jtrain's own MLP
and optimizer built inside the step; train/sharpness (the loss at the ascent point minus
the loss at w) and train/grad_norm logged beside train/loss; evaluation of the logits by
jtrain's classification metrics; checkpoints and bitwise resume of params + AdamW state.
Variants: `debug` (fewer steps).
"""

from jtrain.config import defaults, variant_of

VARIANTS = ("", "debug")


def get_config(variant=None):
    variant = variant_of("configs/recipes/sam.py", variant, VARIANTS)
    config = defaults()
    config.step.factory = "jtrain.recipes.sam:make"
    config.step.kwargs = {"hidden": [32, 32], "num_outputs": 2, "lr": 1e-3,
                          "weight_decay": 1e-3, "rho": 0.05}
    config.data.source = "jtrain.recipes.sam:make_data"
    config.data.batch_size = 32
    config.eval.metrics = ("loss", "accuracy", "precision_recall_f1")
    config.total_steps = 1000
    config.eval.every_steps = 250
    config.log.every_steps = 50
    config.checkpoint.every_steps = 250
    if variant == "debug":
        config.total_steps = 200
        config.eval.every_steps = 100
        config.log.every_steps = 25
        config.checkpoint.every_steps = 20
    return config
