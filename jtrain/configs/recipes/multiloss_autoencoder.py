"""Recipe: a multi-modal autoencoder with weighted MSE terms and a correlation term.

    python -m jtrain.main --config=configs/recipes/multiloss_autoencoder.py --workdir=runs/ae
    python -m jtrain.main --config=configs/recipes/multiloss_autoencoder.py:debug --workdir=runs/ae_dbg

Demonstrates: an NNX model with two inputs and three outputs (jtrain/recipes/autoencoder.py
has the data process), loss.terms = weighted MSE reconstructions of each modality + a
Pearson-correlation term tying the latent to a shared target, each term logged as
train/<name> and eval/<name>; warmup + cosine decay to optim.end_lr_factor of the peak;
checkpoints every N steps kept (keep_every_steps), the best by eval/loss (keep_top_k)
and the final one. From
Python, `jtrain.train(config, workdir).history` is the per-eval record (README, Recipes).
Variants: `debug` (fewer examples and steps).
"""

from jtrain.config import defaults, variant_of

VARIANTS = ("", "debug")


def get_config(variant=None):
    variant = variant_of("configs/recipes/multiloss_autoencoder.py", variant, VARIANTS)
    config = defaults(model="user")
    config.model.factory = "jtrain.recipes.autoencoder:make_model"
    config.model.kwargs = {"hidden": 64}
    config.data.source = "jtrain.recipes.autoencoder:make_data"
    config.data.kwargs = {"n": 4096}
    config.data.model_inputs = ("rna", "protein")
    config.data.batch_size = 64
    config.loss.terms = {
        "recon_rna": {"fn": "mse", "output": "rna", "target": "rna", "weight": 1.0},
        "recon_protein": {"fn": "mse", "output": "protein", "target": "protein",
                          "weight": 2.0},
        "latent_corr": {"fn": "pearson", "output": "latent", "target": "z", "weight": 0.5},
    }
    config.eval.predict_fn = "jtrain.recipes.autoencoder:latent"
    config.eval.metrics = ("loss", "pearson")
    config.total_steps = 1500
    config.optim.lr = 3e-3
    config.optim.schedule = "warmup_cosine"
    config.optim.warmup_steps = 100
    config.optim.end_lr_factor = 0.05
    config.eval.every_steps = 250
    config.log.every_steps = 125
    config.checkpoint.every_steps = 500
    config.checkpoint.max_to_keep = 2
    config.checkpoint.keep_every_steps = 500
    config.checkpoint.keep_top_k = 1
    config.checkpoint.monitor = "eval/loss"
    if variant == "debug":
        config.data.kwargs = {"n": 2048}
        config.total_steps = 300
        config.optim.warmup_steps = 30
        config.eval.every_steps = 100
        config.log.every_steps = 50
        config.checkpoint.every_steps = 100
        config.checkpoint.keep_every_steps = 100
    return config
