"""Recipe: binary classification with early stopping on F1, best checkpoint evaluated.

    python -m jtrain.main --config=configs/recipes/classify.py --workdir=runs/classify
    python -m jtrain.evaluate --workdir=runs/classify --step=best
    python -m jtrain.main --config=configs/recipes/classify.py:debug --workdir=runs/cls_dbg

Demonstrates: a real table that ships inside scikit-learn (breast cancer: 569 tumours,
30 features; jtrain/recipes/classify.py), an MLP, early stopping on eval/f1_macro (mode
max, patience, min_delta), checkpoints ranked by the same metric, and
`python -m jtrain.evaluate --step=best` writing WORKDIR/eval_<step>.json: accuracy,
F1, precision, recall, AUROC, the confusion matrix and the classification report.
Variants: `debug` (fewer steps, evals more often).
"""

from jtrain.config import defaults, variant_of

VARIANTS = ("", "debug")


def get_config(variant=None):
    variant = variant_of("configs/recipes/classify.py", variant, VARIANTS)
    config = defaults(model="mlp")
    config.model.hidden = (32, 32)
    config.model.num_outputs = 2
    config.model.dropout = 0.1
    config.data.source = "jtrain.recipes.classify:make_data"
    config.data.batch_size = 32
    config.total_steps = 2000
    config.optim.lr = 1e-3
    config.optim.warmup_steps = 20
    config.optim.weight_decay = 1e-3
    config.eval.every_steps = 25
    config.eval.metrics = ("loss", "accuracy", "precision_recall_f1", "auroc",
                           "confusion_matrix")
    config.log.every_steps = 25
    config.early_stop.monitor = "eval/f1_macro"
    config.early_stop.mode = "max"
    config.early_stop.patience = 8
    config.early_stop.min_delta = 0.002
    config.checkpoint.every_steps = 100
    config.checkpoint.monitor = "eval/f1_macro"
    config.checkpoint.mode = "max"
    if variant == "debug":
        config.total_steps = 300
        config.early_stop.patience = 4
    return config
