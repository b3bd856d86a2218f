"""Recipe: BYOL, self-supervised, with an EMA target network kept by the step.

    python -m jtrain.main --config=configs/recipes/byol.py --workdir=runs/byol
    python -m jtrain.main --config=configs/recipes/byol.py:debug --workdir=runs/byol_dbg

Demonstrates: `step.factory` (jtrain/recipes/byol.py) with a target encoder + projector
that is an exponential moving average of the online ones, updated inside the step (not by
optim.ema) and kept in the step's state (checkpointed, resumed bitwise); two augmented
views per example drawn from the step's rng; the symmetrised normalised-MSE loss;
train/target_drift (the distance between target and online weights) logged; evaluation
of what `evaluate` returns (the representation) by a batch-level loss.fn, the share of
its variance within clusters (eval/loss). The quality contract is a linear probe
(`jtrain.recipes.byol.probe_accuracy`): trained encoder against untrained.
Variants: `debug` (fewer steps).
"""

from jtrain.config import defaults, variant_of

VARIANTS = ("", "debug")


def get_config(variant=None):
    variant = variant_of("configs/recipes/byol.py", variant, VARIANTS)
    config = defaults()
    config.step.factory = "jtrain.recipes.byol:make"
    config.step.kwargs = {"width": 64, "rep": 8, "proj": 16, "lr": 3e-3, "tau": 0.99,
                          "noise": 0.5, "keep": 0.8}
    config.data.source = "jtrain.recipes.byol:make_data"
    config.data.batch_size = 128
    config.loss.fn = "jtrain.recipes.byol:eval_loss"
    config.loss.eval_scope = "batch"
    config.eval.metrics = ("loss",)
    config.total_steps = 2000
    config.eval.every_steps = 500
    config.log.every_steps = 100
    config.checkpoint.every_steps = 500
    if variant == "debug":
        config.total_steps = 300
        config.eval.every_steps = 150
        config.log.every_steps = 50
        config.checkpoint.every_steps = 20
    return config
