"""Recipe: direct preference optimisation (DPO) of an SFT run, as a step of your own.

    python examples/instruct/make_data.py      # chat.jsonl, pairs.jsonl, pairs_eval.jsonl
    python -m jtrain.main --config=configs/recipes/sft.py:debug --workdir=runs/sft
    python -m jtrain.main --config=configs/recipes/dpo.py:debug --workdir=runs/dpo \\
        --config.init.path=runs/sft

Demonstrates: `step.factory` (jtrain/recipes/dpo.py) with the policy trained by AdamW
and a frozen reference (no gradient, no optimizer state) in one state, both filled from
the SFT run by `init.path` with `init.into = "policy,ref"`; preference pairs from JSONL
({prompt, chosen, rejected}) rendered through the chat template, the loss on the
answers' tokens; train/margin (the policy's chosen minus rejected log-probability) and
train/reward_accuracy logged beside train/loss; eval/loss is the DPO loss on the
held-out pairs. step.kwargs.model must give the sizes of the run it starts from.
`jtrain export RUN --out=DIR --subtree=policy` writes the tuned model.
"""

from jtrain.config import defaults, variant_of

VARIANTS = ("", "debug")
SFT_MODEL = {"d_model": 64, "num_layers": 2, "num_heads": 4, "d_ff": 256, "max_len": 128}


def get_config(variant=None):
    variant = variant_of("configs/recipes/dpo.py", variant, VARIANTS)
    config = defaults()
    config.seed = 0
    config.step.factory = "jtrain.recipes.dpo:make"
    config.step.kwargs = {"model": SFT_MODEL, "beta": 0.1, "lr": 1e-3}
    config.init.path = "runs/sft"
    config.init.into = "policy,ref"
    config.data.source = "jtrain.recipes.dpo:make_data"
    config.data.kwargs = {"path": "pairs.jsonl", "eval_path": "pairs_eval.jsonl",
                          "seq_len": 64}
    config.data.batch_size = 8
    config.loss.fn = "jtrain.recipes.dpo:eval_loss"
    config.eval.metrics = ("loss",)
    config.total_steps = 100
    config.eval.every_steps = 50
    config.log.every_steps = 10
    config.checkpoint.every_steps = 50
    if variant == "debug":
        config.total_steps = 40
        config.eval.every_steps = 20
        config.checkpoint.every_steps = 5
    return config
