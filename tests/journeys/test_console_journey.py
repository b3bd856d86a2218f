"""What a person sees while a run goes, as users meet it: subprocesses from a temp cwd with
relative paths and no test helpers. A plain script with an NNX model on a stream without
`__len__` (the epoch length learned after one epoch), rerun unchanged (the stored
result), rerun changed (the `allow_changes=` argument named) and a second run
`init_from` the first; a CLI run stopped by an external SIGINT (the one stop line, in
train.log and summary.json, no stale eval as final); the CLI under a
pseudo-terminal at 80 columns (the bar's kept fields, nothing redrawn after the final
line) on `configs/base.py:debug --config.total_steps=10` (the warmup fitted, with a
notice), and the bar alone at 120 columns."""

import fcntl
import json
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from journey import copy_project, run_python, user_env

REPO = Path(__file__).resolve().parents[2]

SCRIPT = '''
import json
import numpy as np
from flax import nnx
import jtrain
from jtrain.errors import RestoreError
from nnx_mlp import Model  # the user's own module


class Stream:
    """Re-iterable, no __len__: jtrain cannot know an epoch's length up front."""

    def __iter__(self):
        r = np.random.default_rng(0)
        for _ in range(40):  # 5 batches of 8
            x = r.normal(size=4).astype(np.float32)
            yield {"inputs": x, "targets": np.int32(x[0] > 0)}


r = np.random.default_rng(1)
x = r.normal(size=(16, 4)).astype(np.float32)
eval_data = {"inputs": x, "targets": (x[:, 0] > 0).astype(np.int32)}
config = {"total_steps": 12, "data": {"batch_size": 8}, "eval": {"every_steps": 6},
          "log": {"every_steps": 3, "writers": ["jsonl"]},
          "optim": {"lr": 0.05, "warmup_steps": 2}}


def run(cfg, workdir, **kw):
    return jtrain.train(cfg, workdir, model=Model(nnx.Rngs(0)), train_data=Stream(),
                        eval_data=eval_data, **kw)


first = run(config, "runs/a")
print("FIRST", type(first).__name__, first.summary["step"], flush=True)
again = run(config, "runs/a")
with open("runs/a/summary.json") as f:
    stored = json.load(f)
print("AGAIN", type(again).__name__, again.summary == stored,
      again.summary["state_sha256"] == first.summary["state_sha256"],
      [e["step"] for e in again.history], flush=True)
try:
    run({**config, "optim": {"lr": 0.1, "warmup_steps": 2}}, "runs/a")
except RestoreError as e:
    print("CHANGED", e, flush=True)
# the schedule of runs/a (decay until step 12), so its compiled train step serves this run
fine = run({**config, "total_steps": 3, "optim": {**config["optim"], "decay_steps": 12},
            "init": {"path": "runs/a", "exclude": ["head"]}}, "runs/b")
print("INIT", fine.summary["step"], flush=True)
'''


def test_library_reruns_stream_epoch_and_init_from(tmp_path):
    copy_project(tmp_path, "nnx_mlp")
    (tmp_path / "script.py").write_text(SCRIPT)
    proc = run_python(tmp_path, "script.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out, err = proc.stdout, proc.stderr
    assert "FIRST TrainResult 12" in out
    # The header: a stream of unknown length, the optimizer and the trainable counts.
    assert ("data Stream (stream): a stream of unknown length train / 16 eval examples, global "
            "batch 8, epoch length unknown until the first epoch ends") in err
    assert ("jtrain: optimizer adamw, peak lr 0.05, warmup_cosine schedule (2 warmup steps, "
            "decay until step 12 to lr x 0), no clipping, 1 microbatch(es) per update") in err
    assert "jtrain: trainable 114 params in 4 leaves; frozen 0 in 0 leaves" in err
    assert re.search(r"jtrain: workdir \S+/runs/a; fresh start\n", err)
    # The epoch of the stream, learned when the reader passed its end (the loop reads a
    # few steps ahead), shown from then on.
    assert err.count("an epoch of the stream is 5 batches") == 1
    bars = [ln for ln in err.splitlines() if ln.startswith("step ")]
    assert bars[0].startswith("step 3/12 [#####---------------] 25% | epoch 0 batch 3/5 |")
    assert "| epoch 1 batch 1/5 |" in bars[1]  # step 6
    # The bar's loss is the window mean metrics.jsonl logs for that step.
    logged = [json.loads(ln) for ln in open(tmp_path / "runs/a/metrics.jsonl")]
    window = {r["step"]: r["train/loss_window"] for r in logged if "train/loss_window" in r}
    assert sorted(window) == [3, 6, 9, 12]
    assert f"| loss {window[3]:.4g} |" in bars[0]
    last = {r["step"]: r["train/loss"] for r in logged if "train/loss" in r}
    assert all(window[s] != last[s] for s in window)  # steps 1-3 averaged, not step 3 alone
    # Unchanged rerun: one line, the stored result (same kind, same summary and state).
    assert err.count("jtrain: already finished at step 12 (summary.json); nothing to do") == 1
    assert "AGAIN TrainResult True True [6, 12]" in out
    assert re.search(r"jtrain: workdir \S+/runs/a; resumed from step 12\n", err)
    # Changed rerun from Python: the keys and the argument to pass, no CLI flag.
    changed = [ln for ln in out.splitlines() if ln.startswith("CHANGED")]
    assert changed == ["CHANGED the config changed since " + changed[0].split("since ")[1]]
    assert "optim.lr 0.05 -> 0.1" in changed[0] and "--config" not in changed[0]
    assert changed[0].endswith("to resume anyway pass jtrain.train(..., "
                               "allow_changes=['optim.lr']), or use a new workdir")
    # init_from: where the weights came from, in the header.
    assert re.search(r"jtrain: workdir \S+/runs/b; initialized from runs/a \(step 12, 2 "
                     r"leaves, 2 excluded\)", err), err[-3000:]
    assert "INIT 3" in out


CONFIG_FILE = '''
from jtrain.config import defaults

def get_config():
    config = defaults(model="mlp")
    config.update({"model": {"num_outputs": 2, "hidden": (16,)},
                   "data": {"source": "tabular:make", "batch_size": 8},
                   "optim": {"name": "sgd", "lr": 0.01, "schedule": "constant"},
                   "total_steps": 100000, "eval": {"every_steps": 4},
                   "log": {"every_steps": 1, "writers": ("jsonl",)}})
    return config
'''


def test_sigint_from_outside_says_what_happened(tmp_path):
    copy_project(tmp_path, "tabular")
    (tmp_path / "myconfig.py").write_text(CONFIG_FILE)
    cmd = [sys.executable, "-m", "jtrain.main", "--config=myconfig.py", "--workdir=runs/x"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=user_env(), stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    seen = []
    for line in proc.stderr:  # plain lines: not a terminal
        seen.append(line)
        if line.startswith("step 6/"):  # after the eval at step 4
            os.kill(proc.pid, signal.SIGINT)
            break
    err = "".join(seen) + proc.stderr.read()  # to the end: the process exits
    proc.wait(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    stop = [ln for ln in err.splitlines() if ln.startswith("jtrain: stopped by SIGINT")]
    assert len(stop) == 1, err[-3000:]
    step = int(re.fullmatch(r"jtrain: stopped by SIGINT at step (\d+); checkpoint saved; "
                            r"rerun the same command to continue", stop[0]).group(1))
    assert "jtrain: done" not in err  # nothing looks like a finished run
    assert err.rstrip().endswith(stop[0])
    summary = json.load(open(tmp_path / "runs/x/summary.json"))
    assert (summary["stopped_by"], summary["step"], summary["message"]) == \
        ("SIGINT", step, stop[0])
    evals = {r["step"]: r["eval/loss"] for r in map(json.loads, open(
        tmp_path / "runs/x/metrics.jsonl")) if "eval/loss" in r}
    assert evals and max(evals) <= step
    if max(evals) < step:  # the last eval is older than the stop: kept apart, with its step
        assert "eval/loss" not in summary
        assert (summary["last_eval"]["step"], summary["last_eval"]["eval/loss"]) == \
            (max(evals), evals[max(evals)])
    else:  # the stop came right after an eval of that very step: it is the result
        assert summary["eval/loss"] == evals[step] and "last_eval" not in summary
    assert os.path.isdir(tmp_path / f"runs/x/checkpoints/{step}")
    log = (tmp_path / "runs/x/train.log").read_text().splitlines()
    assert log[-1].endswith(" " + stop[0])


# -- the terminal ------------------------------------------------------------------------
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _run_on_pty(cwd, args, columns: int, timeout: float = 240.0) -> tuple[int, str]:
    """`python *args` with a pseudo-terminal of `columns` as stdout and stderr."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = user_env(COLUMNS=str(columns), TERM="xterm-256color")
    proc = subprocess.Popen([sys.executable, *args], cwd=cwd, stdin=slave, stdout=slave,
                            stderr=slave, env=env)
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    return proc.wait(timeout=30), out.decode(errors="replace")


def _bars(raw: str) -> list[str]:
    """Every drawing of the bar, as a person would read it (escape codes removed)."""
    return [seg for seg in re.split(r"[\r\n]", _ANSI.sub("", raw)) if seg.startswith("step ")]


def test_terminal_80_columns_debug_smoke_run(tmp_path):
    """`--config.total_steps=10` on the debug config, on an 80-column terminal."""
    code, raw = _run_on_pty(tmp_path, ["-m", "jtrain.main",
                                       f"--config={REPO}/configs/base.py:debug",
                                       "--workdir=runs/debug", "--config.total_steps=10",
                                       "--config.log.every_steps=2",
                                       "--config.eval.num_batches=2"], columns=80)
    text = _ANSI.sub("", raw).replace("\r\n", "\n")
    assert code == 0, text[-3000:]
    assert ("jtrain: note: optim.warmup_steps=10 does not end before total_steps=10: using 1 "
            "(a tenth of the run) for this run") in text
    assert "jtrain: optimizer adamw, peak lr 0.003, warmup_cosine schedule (1 warmup steps" \
        in text and "clip_norm 1, weight decay 0.1" in text
    bars = _bars(raw)
    assert {b.split(" ")[1] for b in bars} == {"2/10", "4/10", "6/10", "8/10", "10/10"}
    for bar in bars:
        assert len(bar) <= 80, bar
        for kept in ("loss ", "| lr ", " steps/s", "| ETA "):
            assert kept in bar, bar
    after = _ANSI.sub("", raw[raw.rindex("jtrain: done at step 10"):]).strip()
    assert after.startswith("jtrain: done at step 10; eval loss")
    assert not re.search(r"[\r\n]", after)  # nothing redrawn after the last line
    summary = json.load(open(tmp_path / "runs/debug/summary.json"))
    assert summary["step"] == 10 and summary["message"].startswith("jtrain: done at step 10")


BAR_SCRIPT = '''
import time
from jtrain.observe import console

clock = iter(range(1000))
console._clock = lambda: float(next(clock))
p = console.Progress(1500, start_step=0, is_primary=True, batches_per_epoch=2199)
for step in range(50, 301, 50):
    p.update(step, {"train/loss": 9.9, "train/loss_window": 1.0 + 1.0 / step,
                    "train/grad_norm": 0.5, "train/lr": 3e-3, "train/skipped_steps": 2.0,
                    "perf/mfu": 0.12})
    if step == 150:
        p.message("jtrain: eval at step 150 (925 examples): loss 1.2340", emphasis=True)
p.final("jtrain: done at step 300")
p.update(350, {"train/loss_window": 1.0})
p.close()
'''


def test_terminal_120_columns_bar(tmp_path):
    (tmp_path / "bar.py").write_text(BAR_SCRIPT)
    code, raw = _run_on_pty(tmp_path, ["bar.py"], columns=120, timeout=60)
    assert code == 0, raw[-3000:]
    bars = _bars(raw)
    assert [b.split(" ")[1] for b in bars][-1] == "300/1500"
    for bar in bars:
        assert len(bar) <= 120, bar
        assert re.match(r"step \d+/1500 \[#*-*\] \d+% \| loss 1\.0\d+ \| skipped_steps 2 \| "
                        r"lr 3\.0e-03 \| 50\.0 steps/s \| ETA \d:\d\d:\d\d$", bar), bar
    assert "\x1b[1mjtrain: eval at step 150" in raw  # eval lines stand out (bold)
    after = _ANSI.sub("", raw[raw.rindex("jtrain: done at step 300"):])
    assert after.strip() == "jtrain: done at step 300"
