"""Recipe: distil the reference transformer (configs/base.py) into a smaller student, as a
step of your own.

    python -m jtrain.main --config=configs/base.py:debug --workdir=runs/teacher
    python -m jtrain.main --config=configs/recipes/distill.py:debug --workdir=runs/student \
        --config.init.path=runs/teacher

Demonstrates: `step.factory` (jtrain/recipes/distill.py) with a frozen teacher (no
optimizer state) and a student in one state; the teacher loaded from a jtrain run (or an
export, or `hf:DIR`) into its sub-tree by `init.path` + `init.into
= "teacher"`; train/ce and train/kd logged beside train/loss; eval/loss is the student's
cross-entropy on the same held-out bytes as the teacher's run; `python -m jtrain.export
RUN --out=DIR --subtree=student` writes the student as a plain export. The data, sizes
and schedule of the teacher's run; the `debug` variant matches configs/base.py:debug.
"""

from jtrain.config import defaults, variant_of

VARIANTS = ("", "debug")


def get_config(variant=None):
    variant = variant_of("configs/recipes/distill.py", variant, VARIANTS)
    config = defaults()
    config.seed = 0
    config.step.factory = "jtrain.recipes.distill:make"
    config.step.kwargs = {
        "teacher": {"d_model": 128, "num_layers": 4, "num_heads": 4, "d_ff": 512,
                    "max_len": 128},
        "student": {"d_model": 64, "num_layers": 2, "num_heads": 4, "d_ff": 256,
                    "max_len": 128},
        "alpha": 0.5, "temperature": 2.0, "lr": 3e-3}
    config.init.into = "teacher"
    config.data.name = "pystdlib"
    config.data.seq_len = 128
    config.data.batch_size = 32
    config.total_steps = 1500
    config.eval.every_steps = 500
    config.eval.num_batches = 20
    config.log.every_steps = 50
    config.checkpoint.every_steps = 500
    if variant == "debug":
        config.step.kwargs = {
            "teacher": {"d_model": 64, "num_layers": 2, "num_heads": 4, "d_ff": 256,
                        "max_len": 64},
            "student": {"d_model": 32, "num_layers": 1, "num_heads": 2, "d_ff": 128,
                        "max_len": 64},
            "alpha": 0.5, "temperature": 2.0, "lr": 3e-3}
        config.total_steps = 150
        config.data.seq_len = 64
        config.data.batch_size = 16
        config.eval.every_steps = 50
        config.eval.num_batches = 10
        config.log.every_steps = 10
        config.checkpoint.every_steps = 50
    return config
