"""A hyperparameter search over the reference model at debug size (configs/base.py:debug).

    python -m jtrain.tune --config=configs/tune.py --workdir=runs/tune
    python -m jtrain.main --config=runs/tune/best_config.py --workdir=runs/tune_best
    python -m jtrain.tune --config=configs/tune.py:quick --workdir=runs/tune_quick

Samples optim.lr (log-uniform), optim.weight_decay (uniform) and data.batch_size (a
choice) with TPE over 8 trials of 120 steps; a median pruner stops trials whose eval loss
at an eval is worse than the median of earlier trials there. Several workers: start the
same command on each machine with --tune.storage=postgresql://user@host/db and the
password in $JTRAIN_TUNE_DB_PASSWORD.
Variants: `quick` (4 trials of 40 steps).
"""

from jtrain.config import defaults, variant_of

VARIANTS = ("", "quick")


def get_config(variant=None):
    variant = variant_of("configs/tune.py", variant, VARIANTS)
    config = defaults(model="transformer")
    config.total_steps = 120
    config.model.d_model = 64
    config.model.num_layers = 2
    config.model.num_heads = 4
    config.model.d_ff = 256
    config.model.max_len = 64
    config.data.name = "pystdlib"
    config.data.seq_len = 64
    config.data.batch_size = 16
    config.optim.warmup_steps = 10
    config.optim.clip_norm = 1.0
    config.eval.every_steps = 30
    config.eval.num_batches = 10
    config.log.every_steps = 30
    config.checkpoint.every_steps = 30

    config.tune.space = {"optim": {"lr": ("log_uniform", 1e-4, 3e-2),
                                   "weight_decay": ("uniform", 0.0, 0.1)},
                         "data": {"batch_size": ("choice", (8, 16, 32))}}
    config.tune.trials = 8
    config.tune.monitor = "eval/loss"
    config.tune.prune_startup_trials = 3

    if variant == "quick":
        config.total_steps = 40
        config.eval.every_steps = 20
        config.checkpoint.every_steps = 20
        config.tune.trials = 4
    return config
