"""Recipe: classify token sets from few labels, fine-tuned from masked pretraining.

    python -m jtrain.main --config=configs/recipes/masked_pretrain.py --workdir=runs/pretrain
    python -m jtrain.main --config=configs/recipes/finetune.py:full --workdir=runs/ft_full
    python -m jtrain.main --config=configs/recipes/finetune.py:frozen --workdir=runs/ft_frozen
    python -m jtrain.main --config=configs/recipes/finetune.py:lora --workdir=runs/ft_lora
    python -m jtrain.main --config=configs/recipes/finetune.py:scratch --workdir=runs/ft_scratch
    python -m jtrain.recipes.report runs/ft_scratch runs/ft_full runs/ft_frozen runs/ft_lora

Demonstrates: init.path the pretraining run's best checkpoint
(init.step=best) with a new head (init.exclude), in three
variants: `full` (everything trains), `frozen` (optim.frozen = the encoder: only the head
trains), `lora` (finetune.lora: rank-4 adapters in the encoder, plus the head); `scratch`
is the same classifier from a fresh init, the baseline. Add `,debug` (`:full,debug`) for
the short pretraining run's settings. The pretrained run is read from runs/pretrain
(`--config.init.path=DIR` for another).
"""

from jtrain.config import defaults

KINDS = ("full", "frozen", "lora", "scratch")


def get_config(variant=None):
    parts = [p for p in (variant or "full").split(",") if p]
    kind = [p for p in parts if p in KINDS]
    if len(kind) != 1 or any(p not in (*KINDS, "debug") for p in parts):
        raise ValueError(f"configs/recipes/finetune.py: unknown variant {variant!r}; choose "
                         "one of full, frozen, lora, scratch (optionally ',debug')")
    kind, debug = kind[0], "debug" in parts
    config = defaults(model="user")
    config.model.factory = "jtrain.recipes.pretrain:make_classifier"
    config.model.kwargs = {"width": 64, "layers": 2, "heads": 4}
    config.data.source = "jtrain.recipes.pretrain:make_finetune_data"
    config.data.kwargs = {"labelled": 64}
    config.data.batch_size = 32
    config.total_steps = 300
    config.optim.lr = 1e-3
    config.optim.warmup_steps = 20
    config.eval.every_steps = 100
    config.log.every_steps = 50
    config.checkpoint.every_steps = 0
    config.checkpoint.monitor = "eval/accuracy"
    config.checkpoint.mode = "max"
    if kind != "scratch":
        config.init.path = "runs/pretrain"
        config.init.step = "best"
        config.init.exclude = ("cls_head",)
    if kind == "frozen":
        config.optim.frozen = ("encoder",)
        config.optim.lr = 1e-2
    if kind == "lora":
        config.finetune.lora.rank = 4
        config.finetune.lora.targets = "encoder"
        config.optim.trainable = ("cls_head",)
        config.optim.lr = 5e-3
    if debug:
        config.total_steps = 150
        config.eval.every_steps = 75
    return config
