"""Batch-scope eval on two processes (jax.distributed over loopback): the partial last
batch is gathered from both processes and scored at its true size, so the eval loss of a
batch-mean loss that ignores padding is the numpy mean over exactly the eval set, and
both processes report the same number. A user script, as a user runs it."""

import json
import socket
import subprocess
import sys
import textwrap

from journey import user_env

SCRIPT = textwrap.dedent('''
    import json, sys
    import jax
    jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
    import jax.numpy as jnp
    import numpy as np
    import jtrain

    W = np.array([[0.5, -1.0], [2.0, 0.25], [-0.75, 1.5]], np.float32)

    def init(rng, x):
        return {"w": jnp.asarray(W)}

    def apply(params, x, rng=None, train=False):
        return x @ params["w"]

    def loss_fn(out, batch):  # a batch mean that knows nothing of padding
        return jnp.mean((out - batch["targets"]) ** 2)

    r = np.random.default_rng(1)
    x = r.normal(size=(37, 3)).astype(np.float32)  # 4 global batches of 8 + 5 rows
    y = r.normal(size=(37, 2)).astype(np.float32)
    config = {"total_steps": 1, "data": {"batch_size": 8, "shuffle": False},
              "eval": {"every_steps": 0, "batch_size": 8}, "loss": {"eval_scope": "batch"},
              "log": {"writers": ["jsonl"]},
              "optim": {"name": "sgd", "lr": 0.0, "schedule": "constant"}}
    result = jtrain.train(config, "run", model=(init, apply), loss_fn=loss_fn,
                          train_data={"inputs": x, "targets": y},
                          eval_data={"inputs": x, "targets": y})
    print(json.dumps({"got": result.history[-1]["eval/loss"],
                      "want": float(((x @ W - y) ** 2).mean())}))
''')


def test_batch_scope_eval_is_exact_on_two_processes(tmp_path):
    (tmp_path / "two.py").write_text(SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "two.py", f"127.0.0.1:{port}", str(i)],
                              cwd=tmp_path, env=user_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert results[0]["got"] == results[1]["got"]
    assert abs(results[0]["got"] - results[0]["want"]) <= 2e-6 * results[0]["want"]
