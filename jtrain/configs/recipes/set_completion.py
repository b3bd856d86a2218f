"""Recipe: multi-label set completion, ReduceLROnPlateau + early stopping, 2 processes.

    DEVICES=1 launch/local.sh 2 --config=configs/recipes/set_completion.py --workdir=runs/sets
    python -m jtrain.main --config=configs/recipes/set_completion.py --workdir=runs/sets1
    DEVICES=1 launch/local.sh 2 --config=configs/recipes/set_completion.py:debug --workdir=runs/sets_dbg

Demonstrates: partial token sets in, the missing members out (a score per vocabulary
token, sigmoid cross-entropy; jtrain/recipes/set_completion.py has the data process),
the hidden members drawn in the step from the step's key; ReduceLROnPlateau on
eval/loss (plateau.*) and early stopping on it (early_stop.*); data parallel over 2 local
processes (each reads half of every global batch). Result: eval recall_at_10 against the
popularity baseline printed at start-up. Variants: `debug` (fewer sets and steps).
"""

from jtrain.config import defaults, variant_of

VARIANTS = ("", "debug")


def get_config(variant=None):
    variant = variant_of("configs/recipes/set_completion.py", variant, VARIANTS)
    config = defaults(model="user")
    config.model.factory = "jtrain.recipes.set_completion:make_model"
    config.model.kwargs = {"width": 64, "layers": 2, "heads": 4}
    config.data.source = "jtrain.recipes.set_completion:make_data"
    config.data.kwargs = {"n": 8192}
    config.data.batch_size = 64
    config.loss.fn = "jtrain.recipes.set_completion:loss"
    config.loss.eval_scope = "batch"
    config.eval.metrics = ("loss",)
    config.total_steps = 3000
    config.optim.lr = 3e-3
    config.optim.schedule = "constant"
    config.optim.warmup_steps = 50
    config.optim.clip_norm = 1.0
    config.eval.every_steps = 200
    config.log.every_steps = 100
    config.checkpoint.every_steps = 500
    config.plateau.monitor = "eval/loss"
    config.plateau.factor = 0.5
    config.plateau.patience = 1
    config.plateau.min_delta = 0.01
    config.early_stop.monitor = "eval/loss"
    config.early_stop.patience = 4
    config.early_stop.min_delta = 0.01
    if variant == "debug":
        config.data.kwargs = {"n": 4096}
        config.total_steps = 400
        config.eval.every_steps = 50
        config.log.every_steps = 50
        config.checkpoint.every_steps = 200
        config.plateau.min_delta = 0.05
        config.early_stop.patience = 3
        config.early_stop.min_delta = 0.05
    return config
