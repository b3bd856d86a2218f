"""The Hugging Face journey (docs/guide/huggingface.md): train the built-in transformer
with Llama's MLP from the `jtrain` command, export it with `--format=hf`, and load it in
a plain script with transformers: the byte tokenizer encodes text as the bytes the model
was trained on, and the logits equal jtrain's."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np

from jtrain import make_model
from jtrain.recipes.report import load_run

from journey import run_python, user_env

CONFIG = '''
from jtrain.config import defaults


def get_config(arg=None):
    c = defaults(model="transformer")
    c.total_steps = 3
    c.model.update(d_model=32, num_layers=2, num_heads=4, d_ff=64, max_len=32, mlp="swiglu")
    c.data.update(name="pystdlib", seq_len=32, batch_size=8)
    c.eval.num_batches = 1
    return c
'''

TEXT = "def main():\n    return 0  # é\n"

SCRIPT = '''
import json

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("exports/hf")
model = AutoModelForCausalLM.from_pretrained("exports/hf")
text = {text!r}
ids = tokenizer(text, return_tensors="pt")["input_ids"]
with torch.no_grad():
    theirs = model(ids).logits.numpy()

np.save("theirs.npy", theirs)
print(json.dumps({"ids_are_bytes": ids[0].tolist() == list(text.encode()),
                  "decoded": tokenizer.decode(ids[0]) == text,
                  "architecture": model.config.architectures[0]}))
'''


def test_train_export_hf_and_load_with_transformers(tmp_path):
    (tmp_path / "cfg.py").write_text(CONFIG)
    (tmp_path / "compare.py").write_text(SCRIPT.replace("{text!r}", repr(TEXT)))
    jtrain = os.path.join(os.path.dirname(sys.executable), "jtrain")

    def cli(*args):
        proc = subprocess.run([jtrain, *args], cwd=tmp_path, env=user_env(), text=True,
                              capture_output=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    cli("train", "--config=cfg.py", "--workdir=runs/lm")
    proc = cli("export", "runs/lm", "--format=hf", "--out=exports/hf")
    assert proc.stdout.startswith("jtrain: exported step 3:")
    assert "exports/hf as LlamaForCausalLM (Hugging Face; byte-level tokenizer)" in proc.stdout
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(
        os.listdir(tmp_path / "exports" / "hf"))
    proc = run_python(tmp_path, "compare.py", HF_HUB_OFFLINE="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["ids_are_bytes"] and got["decoded"], got
    assert got["architecture"] == "LlamaForCausalLM"
    # jtrain's logits for the same bytes, from the run's checkpoint (read here: the user's
    # side of the journey is the transformers script above)
    config, params = load_run(str(tmp_path / "runs" / "lm"), step="latest")
    ids = np.array([list(TEXT.encode())])
    ours = make_model(config["model"], dtype=jnp.float32, param_dtype=jnp.float32).apply(
        {"params": params}, ids)
    theirs = np.load(tmp_path / "theirs.npy")
    assert theirs.shape == ours.shape, (theirs.shape, ours.shape)
    assert float(np.abs(np.asarray(ours) - theirs).max()) < 1e-4
