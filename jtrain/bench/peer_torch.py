"""The PyTorch side of `python -m jtrain.bench peers`: the same work in plain PyTorch and
in PyTorch Lightning. Run as a script by path (`python .../peer_torch.py SPEC.json`) so
that the process imports torch and Lightning only, never jtrain or JAX; it prints one
JSON line of results. `digits()` (torch Datasets) is a `data.source` too; the jtrain
side of `peers` reads the same arrays through jtrain/bench/digits.py.

The LM twin of jtrain.models.transformer at the same dimensions: byte embedding (normal,
std d^-1/2) tied to the output projection, pre-norm blocks (RMSNorm eps 1e-6 -> causal
attention with RoPE on q and k -> residual, RMSNorm -> tanh-GELU MLP -> residual), no
biases, final RMSNorm; q/k/v/out/MLP weights truncated-normal with variance 1/fan_in
(flax's lecun_normal). AdamW (b1 0.9, b2 0.999, eps 1e-8), weight decay on the matmul
weights only (not embeddings or norm scales, as jtrain's mask), global-norm clipping, a
linear warmup from 0 then cosine to 0 at the last step, mean token cross-entropy. It is
fed the byte windows jtrain's pipeline yields, in the same order (written by the parent).
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time

if __name__ == "__main__" and sys.path and \
        os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]  # run by path: keep this folder's data.py, cli.py, ... out of imports

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402


def _digits_module():
    """jtrain/bench/digits.py, loaded by path (this script imports no jtrain)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "digits.py")
    spec = importlib.util.spec_from_file_location("jtrain_bench_digits", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Digits(torch.utils.data.Dataset):
    """scikit-learn's 8x8 digits as (float32 [64] in [0, 1], int64 label); the fixed split
    of digits.py, whose arrays the jtrain side reads directly."""

    def __init__(self, split: str):
        x, y = _digits_module().arrays(split)
        self.x, self.y = torch.from_numpy(x), torch.from_numpy(y)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def digits():
    """jtrain's `data.source` for the MLP case: the same Dataset objects as the peers."""
    return {"train": Digits("train"), "eval": Digits("eval")}


class Windows(torch.utils.data.Dataset):
    """Byte windows [N, T+1] -> (inputs [T], targets [T]) as int64."""

    def __init__(self, windows: np.ndarray):
        self.w = torch.from_numpy(windows.astype(np.int64))

    def __len__(self):
        return len(self.w)

    def __getitem__(self, i):
        return self.w[i, :-1], self.w[i, 1:]


def _lecun_(w: torch.Tensor, fan_in: int) -> None:
    std = math.sqrt(1.0 / fan_in) / 0.87962566103423978  # flax: truncated normal at 2 std
    nn.init.trunc_normal_(w, std=std, a=-2 * std, b=2 * std)


def _rope(x: torch.Tensor) -> torch.Tensor:  # x [B, T, H, Dh], as jtrain's _rope
    t, dh = x.shape[1], x.shape[-1]
    half = dh // 2
    freq = 1.0 / (10_000.0 ** (torch.arange(half, dtype=torch.float32) / half))
    angle = torch.arange(t, dtype=torch.float32)[:, None] * freq[None, :]
    sin, cos = torch.sin(angle)[None, :, None, :], torch.cos(angle)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Block(nn.Module):
    def __init__(self, d: int, h: int, f: int):
        super().__init__()
        self.h = h
        self.attn_norm, self.mlp_norm = nn.RMSNorm(d, eps=1e-6), nn.RMSNorm(d, eps=1e-6)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.wi, self.wo = nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False)
        for lin, fan_in in ((self.qkv, d), (self.out, d), (self.wi, d), (self.wo, f)):
            _lecun_(lin.weight, fan_in)

    def forward(self, x):  # [B, T, D]
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.h, d // self.h).unbind(2)
        q, k = _rope(q), _rope(k)
        ctx = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        x = x + self.out(ctx.transpose(1, 2).reshape(b, t, d))
        return x + self.wo(F.gelu(self.wi(self.mlp_norm(x)), approximate="tanh"))


class TorchLM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, f: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        nn.init.normal_(self.embed.weight, std=d ** -0.5)
        self.blocks = nn.ModuleList(Block(d, heads, f) for _ in range(layers))
        self.final_norm = nn.RMSNorm(d, eps=1e-6)

    def forward(self, tokens):  # [B, T] -> logits [B, T, V]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.final_norm(x) @ self.embed.weight.T


def make_mlp(hidden, classes: int, inputs: int = 64) -> nn.Module:
    layers, width = [], inputs
    for h in hidden:
        layers += [nn.Linear(width, h), nn.GELU(approximate="tanh")]
        width = h
    mlp = nn.Sequential(*layers, nn.Linear(width, classes))
    for m in mlp:
        if isinstance(m, nn.Linear):
            _lecun_(m.weight, m.in_features)
            nn.init.zeros_(m.bias)
    return mlp


def make_optimizer(model: nn.Module, spec: dict):
    """AdamW or Adam, decay on >= 2-D weights except the embedding; warmup + cosine."""
    o = spec["optim"]
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    groups = [{"params": decay, "weight_decay": o["weight_decay"]},
              {"params": rest, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=o["lr"], betas=(0.9, 0.999), eps=1e-8)
    warmup, total = o["warmup_steps"], spec["steps"]

    def factor(step):
        if o["schedule"] == "constant":
            return 1.0
        if step < warmup:
            return step / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def build(spec: dict):
    """(model, loss(model, batch) -> (mean loss, metric count), train set, eval set)."""
    torch.manual_seed(spec["seed"])
    if spec["case"] == "mlp":
        model = make_mlp(spec["mlp_hidden"], 10)
        train, evalset = Digits("train"), Digits("eval")
    else:
        m = spec["lm"]
        model = TorchLM(256, m["d_model"], m["num_layers"], m["num_heads"], m["d_ff"])
        train = Windows(np.load(spec["train_windows"]))
        evalset = Windows(np.load(spec["eval_windows"]))
    return model, train, evalset


def loss_fn(model, batch):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def evaluate(model, evalset, batch: int, case: str) -> float:
    """Mean eval loss (LM, token-weighted) or accuracy (MLP) over the whole eval set."""
    model.eval()
    total, count = 0.0, 0
    for x, y in torch.utils.data.DataLoader(evalset, batch_size=batch):
        logits = model(x)
        if case == "mlp":
            total += float((logits.argmax(-1) == y).sum())
        else:
            total += float(F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1),
                                           reduction="sum"))
        count += y.numel()
    model.train()
    return total / count


def train_loader(train, spec):
    shuffle = spec["case"] == "mlp"  # LM windows come in jtrain's order already
    return torch.utils.data.DataLoader(
        train, batch_size=spec["batch"], shuffle=shuffle, drop_last=True,
        generator=torch.Generator().manual_seed(spec["seed"]))


def run_plain(spec: dict, rec: dict) -> None:
    model, train, evalset = build(spec)
    opt, sched = make_optimizer(model, spec)
    step, loader = 0, train_loader(train, spec)  # one loader: a new order every epoch
    while step < spec["steps"]:
        for batch in loader:
            loss = loss_fn(model, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if spec["optim"]["clip_norm"] > 0:
                nn.utils.clip_grad_norm_(model.parameters(), spec["optim"]["clip_norm"])
            opt.step()
            sched.step()
            step += 1
            rec["losses"].append(float(loss)) if step % spec["log_every"] == 0 else None
            rec["step_end"].append(time.time())
            if step % spec["eval_every"] == 0 or step == spec["steps"]:
                rec["evals"].append((step, time.time(), evaluate(model, evalset, spec["batch"],
                                                                 spec["case"])))
            if step == spec["steps"]:
                break


def run_lightning(spec: dict, rec: dict) -> None:
    import lightning as L

    model, train, evalset = build(spec)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, i):
            return loss_fn(self.model, batch)

        def configure_optimizers(self):
            opt, sched = make_optimizer(self.model, spec)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Timer(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, i):
            step = trainer.global_step
            if step % spec["log_every"] == 0:
                rec["losses"].append(float(outputs["loss"]))
            rec["step_end"].append(time.time())
            if step % spec["eval_every"] == 0 or step == spec["steps"]:
                # The same evaluation as the plain side, inside Lightning's loop.
                rec["evals"].append((step, time.time(), evaluate(module.model, evalset,
                                                                 spec["batch"], spec["case"])))

    trainer = L.Trainer(
        max_steps=spec["steps"], accelerator="cpu", devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        gradient_clip_val=spec["optim"]["clip_norm"] or None, callbacks=[Timer()],
        num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(Module(), train_dataloaders=train_loader(train, spec))


def main(argv) -> int:
    with open(argv[1]) as f:
        spec = json.load(f)
    rec = {"losses": [], "step_end": [], "evals": []}
    {"torch": run_plain, "lightning": run_lightning}[spec["side"]](spec, rec)
    rec["steps"] = len(rec["step_end"])
    rec["threads"] = torch.get_num_threads()
    rec["maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("PEER_RESULT " + json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
