"""A researcher's first hour, as they run it: their own NNX model on a dataset whose
fields are named `mask` (their per-example weights) and `valid` (a feature), a batch
mean loss scored with loss.eval_scope=batch, from a plain script in a fresh directory.
The eval loss jtrain prints equals the one the script computes itself with numpy."""

import json
import textwrap

from journey import run_python

SCRIPT = textwrap.dedent('''
    import json
    import numpy as np
    import jax.numpy as jnp
    from flax import nnx
    import jtrain

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 1, rngs=rngs)

        def __call__(self, batch):  # the whole batch: x and the feature named valid
            return self.lin(batch["x"] + batch["valid"])[:, 0]

    def loss_fn(out, batch):  # a weighted batch mean; the weights live in "mask"
        m = batch["mask"]
        return jnp.sum(m * (out - batch["y"]) ** 2) / jnp.maximum(m.sum(), 1e-9)

    def split(n, seed):
        r = np.random.default_rng(seed)
        return {"x": r.normal(size=(n, 4)).astype(np.float32),
                "valid": np.zeros((n, 4), np.float32),
                "mask": (r.random(n) > 0.5).astype(np.float32),
                "y": r.normal(size=n).astype(np.float32)}

    train, ev = split(64, 0), split(37, 1)  # 37 = 4 batches of 8 + 5
    model = Net(nnx.Rngs(0))
    config = {"total_steps": 3, "data": {"batch_size": 8},
              "eval": {"every_steps": 0, "batch_size": 8},
              "loss": {"eval_scope": "batch"}, "log": {"writers": ["jsonl"]},
              "optim": {"name": "sgd", "lr": 0.0, "schedule": "constant"}}
    result = jtrain.train(config, "runs/first", model=model, train_data=train,
                          eval_data=ev, loss_fn=loss_fn)
    out = np.asarray(model(ev))  # lr 0: the parameters the run evaluated with
    per_batch = [(loss_fn(out[i:i + 8], {k: v[i:i + 8] for k, v in ev.items()}),
                  len(out[i:i + 8])) for i in range(0, 37, 8)]
    want = sum(float(l) * n for l, n in per_batch) / 37
    print(json.dumps({"jtrain": result.history[-1]["eval/loss"], "numpy": want,
                      "skipped": result.summary["skipped_steps"]}))
''')


def test_user_fields_and_batch_scope_from_a_script(tmp_path):
    (tmp_path / "first_hour.py").write_text(SCRIPT)
    proc = run_python(tmp_path, "first_hour.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["skipped"] == 0  # a feature named `valid` (all zeros) skips nothing
    assert abs(got["jtrain"] - got["numpy"]) <= 2e-6 * abs(got["numpy"]), got
    assert (tmp_path / "runs" / "first" / "summary.json").exists()
