"""Recipe: impute missing genomic tracks (jtrain/recipes/imputation.py has the process).

    python -m jtrain.main --config=configs/recipes/imputation.py --workdir=runs/imputation
    python -m jtrain.recipes.report runs/imputation
    python -m jtrain.main --config=configs/recipes/imputation.py:debug --workdir=runs/imp_dbg

Demonstrates: a torch IterableDataset of (positions x features) tracks with availability
masks and metadata; random masking of available features inside the jitted step, keyed by
the step (exact resume); NB NLL on counts + Gaussian NLL on p-values with observed /
imputed terms logged; eval R2, Pearson, Spearman, MSE of the imputed entries. The report
prints them per feature (median), observed vs imputed, against mean imputation.
Variants: `debug` (fewer regions and steps, well under a minute on 2 CPU cores).
"""

from jtrain.config import defaults, variant_of

VARIANTS = ("", "debug")


def get_config(variant=None):
    variant = variant_of("configs/recipes/imputation.py", variant, VARIANTS)
    config = defaults(model="user")
    config.model.factory = "jtrain.recipes.imputation:make_model"
    config.model.kwargs = {"width": 64, "layers": 2}
    config.data.source = "jtrain.recipes.imputation:make_data"
    config.data.kwargs = {"seed": 0, "samples": 12, "regions": 60, "positions": 32}
    config.data.batch_size = 32
    config.loss.fn = "jtrain.recipes.imputation:loss"
    config.loss.eval_scope = "batch"
    config.eval.predict_fn = "jtrain.recipes.imputation:predict"
    config.eval.metrics = ("loss", "r2", "pearson", "spearman", "mse")
    config.total_steps = 1200
    config.optim.lr = 3e-3
    config.optim.warmup_steps = 50
    config.optim.clip_norm = 1.0
    config.eval.every_steps = 200
    config.log.every_steps = 100
    config.checkpoint.every_steps = 400
    config.checkpoint.monitor = "eval/pearson"
    config.checkpoint.mode = "max"
    if variant == "debug":
        config.data.kwargs = {"seed": 0, "samples": 12, "regions": 20, "positions": 32}
        config.total_steps = 300
        config.eval.every_steps = 100
        config.log.every_steps = 50
        config.checkpoint.every_steps = 100
    return config
