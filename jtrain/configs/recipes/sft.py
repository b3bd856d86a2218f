"""Recipe: supervised fine-tuning on chat data (data.name=chat), the loss on the
assistant's tokens only.

    python examples/instruct/make_data.py      # chat.jsonl, pairs.jsonl, pairs_eval.jsonl
    python -m jtrain.main --config=configs/recipes/sft.py:debug --workdir=runs/sft
    jtrain sample runs/sft --prompt $'<|user|>\\ncolour of the sky?<|end|>\\n<|assistant|>\\n' \
        --stop '<|end|>'

Demonstrates: JSONL conversations rendered through data.chat_template (the default,
<|role|>\\ncontent<|end|>\\n), byte tokens, packed first-fit into windows with
segment_ids, the prompt tokens weighted 0 (jtrain/data/chat.py); the built-in
transformer trained from scratch (or from a pretrained run: --config.init.path=RUN with
the same model.* sizes). Greedy samples answer after the assistant header and stop at
the end tag. Then configs/recipes/dpo.py tunes the result on preference pairs.
"""

from jtrain.config import defaults, variant_of

VARIANTS = ("", "debug")


def get_config(variant=None):
    variant = variant_of("configs/recipes/sft.py", variant, VARIANTS)
    config = defaults()
    config.seed = 0
    config.model.update(d_model=64, num_layers=2, num_heads=4, d_ff=256, max_len=128)
    config.data.name = "chat"
    config.data.path = "chat.jsonl"
    config.data.packing = "first_fit"
    config.data.seq_len = 128
    config.data.batch_size = 8
    config.data.val_fraction = 0.1
    config.optim.lr = 3e-3
    config.total_steps = 600
    config.eval.every_steps = 200
    config.log.every_steps = 20
    config.checkpoint.every_steps = 200
    if variant == "debug":
        config.total_steps = 200
        config.eval.every_steps = 100
        config.checkpoint.every_steps = 100
    return config
