"""Recipe: a GAN on a 2-D ring of 8 Gaussians, as a step of your own.

    python -m jtrain.main --config=configs/recipes/gan.py --workdir=runs/gan
    python -m jtrain.main --config=configs/recipes/gan.py:debug --workdir=runs/gan_dbg

Demonstrates: `step.factory` (jtrain/recipes/gan.py: init / update / evaluate as pure
functions) with two models and two optimizers in one state, one discriminator and one
generator update per step, both losses logged (train/d_loss, train/g_loss), evaluation by
jtrain on what `evaluate` returns (eval/loss: the energy distance between generated and
real points, batch-level), checkpoints and bitwise resume of the whole state.
Variants: `debug` (fewer steps).
"""

from jtrain.config import defaults, variant_of

VARIANTS = ("", "debug")


def get_config(variant=None):
    variant = variant_of("configs/recipes/gan.py", variant, VARIANTS)
    config = defaults()
    config.step.factory = "jtrain.recipes.gan:make"
    config.step.kwargs = {"hidden": 64, "lr": 1e-3}
    config.data.source = "jtrain.recipes.gan:make_data"
    config.data.batch_size = 256
    config.loss.fn = "jtrain.recipes.gan:eval_loss"
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
        config.checkpoint.every_steps = 150
    return config
