"""Tests for jtrain.observe.console: plain lines off a terminal, an in-place bar on one."""

import io

import pytest

from jtrain.observe import console as progress
from jtrain.observe.console import Progress


class TTY(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def clock(monkeypatch):
    """A clock that advances one second per reading."""
    t = iter(range(0, 10_000))
    monkeypatch.setattr(progress, "_clock", lambda: float(next(t)))


def test_plain_lines_one_per_update(clock):
    out = io.StringIO()
    p = Progress(100, start_step=0, is_primary=True, stream=out, batches_per_epoch=30, ema=0.5)
    p.update(10, {"train/loss": 1.0, "train/lr": 1e-3, "train/grad_norm": 4.0, "perf/x": 9.0})
    p.update(20, {"train/loss": 3.0, "train/lr": 2e-3, "train/grad_norm": float("nan")})
    p.update(40, {"train/loss": 3.0, "train/learning_rate": 3e-4})
    p.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 3
    assert lines[0] == ("step 10/100 [##------------------] 10% | epoch 0 batch 10/30 | "
                        "loss 1 (ema) | grad_norm 4 | lr 1.0e-03 | 10.0 steps/s | ETA 0:00:09")
    assert lines[1] == ("step 20/100 [####----------------] 20% | epoch 0 batch 20/30 | "
                        "loss 2 (ema) | grad_norm nan | lr 2.0e-03 | 10.0 steps/s | ETA 0:00:08")
    assert lines[2].startswith("step 40/100 [########------------] 40% | epoch 1 batch 10/30 | "
                               "loss 2.5 (ema) | lr 3.0e-04 | 20.0 steps/s | ETA 0:00:03")


def test_resumed_run_counts_from_start_step(clock):
    out = io.StringIO()
    p = Progress(1000, start_step=500, is_primary=True, stream=out)
    p.update(502, {"train/loss": 0.25})
    assert out.getvalue() == ("step 502/1000 [##########----------] 50% | loss 0.25 (ema) | "
                              "2.0 steps/s | ETA 0:04:09\n")


def test_message_lines_and_redaction(clock, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_abcdef123456")
    out = io.StringIO()
    p = Progress(10, start_step=0, is_primary=True, stream=out)
    p.message("training on 1 cpu with hf_abcdef123456")
    p.update(1, {"train/loss": 1.0})
    assert out.getvalue().splitlines()[0] == "training on 1 cpu with <redacted>"


def test_tty_redraws_in_place(clock):
    out = TTY()
    p = Progress(10, start_step=0, is_primary=True, stream=out)
    p.update(1, {"train/loss": 12345.0})
    p.update(2, {"train/loss": 1.0})
    assert out.getvalue().count("\r") == 2 and "\n" not in out.getvalue()
    p.message("eval/loss 0.5")
    value = out.getvalue()
    before, after = value.split("eval/loss 0.5\n")
    assert before.endswith("\r") and after.startswith("step 2/10")  # bar redrawn below
    p.close()
    p.close()
    assert out.getvalue().endswith("\n") and out.getvalue().count("\n") == 2
    p.update(3, {"train/loss": 1.0})  # after close: nothing
    assert out.getvalue().count("step 3/10") == 0


def test_non_primary_prints_nothing(capsys):
    out = TTY()
    p = Progress(10, start_step=0, is_primary=False, stream=out)
    p.update(1, {"train/loss": 1.0})
    p.message("x")
    p.close()
    p2 = Progress(10, start_step=0, is_primary=False)
    p2.update(1, {"train/loss": 1.0})
    assert out.getvalue() == "" and capsys.readouterr() == ("", "")


def test_default_stream_is_stderr(capsys):
    p = Progress(4, start_step=0, is_primary=True)
    p.update(2, {"train/loss": 1.0})
    err = capsys.readouterr().err
    assert err.startswith("step 2/4 [##########----------] 50% | loss 1 (ema) |")
