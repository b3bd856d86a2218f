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
                        "loss 1 | ema 1 | grad_norm 4 | lr 1.0e-03 | 10.0 steps/s | ETA 0:00:09")
    # Bias-corrected: (0.5 * 0.5 * 1 + 0.5 * 3) / (1 - 0.25) = 2.333
    assert lines[1] == ("step 20/100 [####----------------] 20% | epoch 0 batch 20/30 | "
                        "loss 3 | ema 2.333 | grad_norm nan | lr 2.0e-03 | 10.0 steps/s | "
                        "ETA 0:00:08")
    assert lines[2].startswith("step 40/100 [########------------] 40% | epoch 1 batch 10/30 | "
                               "loss 3 | ema 2.714 | lr 3.0e-04 | 20.0 steps/s | ETA 0:00:03")


def test_loss_shown_is_the_window_mean_that_is_logged(clock):
    """The bar's loss is train/loss_window (metrics.jsonl's value for the step), not the
    last step's loss nor a lagging average."""
    out = io.StringIO()
    p = Progress(100, start_step=0, is_primary=True, stream=out)
    p.update(10, {"train/loss": 9.0, "train/loss_window": 2.5})
    assert "| loss 2.5 | ema 2.5 |" in out.getvalue()
    assert "loss_window" not in out.getvalue() and "9" not in out.getvalue().split("|")[1]
    p.close()


def test_ema_is_bias_corrected_and_skips_non_finite():
    ema = progress.EMA(0.9)
    assert ema.value is None
    assert ema.add(5.0) == 5.0  # not 0.5: the first value counts fully
    assert ema.add(float("nan")) == 5.0
    assert ema.add(1.0) == pytest.approx((0.9 * 0.1 * 5 + 0.1 * 1) / (1 - 0.81))


def test_resumed_run_counts_from_start_step(clock):
    out = io.StringIO()
    p = Progress(1000, start_step=500, is_primary=True, stream=out)
    p.update(502, {"train/loss": 0.25})
    assert out.getvalue() == ("step 502/1000 [##########----------] 50% | loss 0.25 | "
                              "ema 0.25 | 2.0 steps/s | ETA 0:04:09\n")
    p.close()


def test_message_lines_and_redaction(clock, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_abcdef123456")
    out = io.StringIO()
    p = Progress(10, start_step=0, is_primary=True, stream=out)
    p.message("training on 1 cpu with hf_abcdef123456")
    p.update(1, {"train/loss": 1.0})
    assert out.getvalue().splitlines()[0] == "training on 1 cpu with <redacted>"
    p.close()


@pytest.mark.parametrize("width", [80, 120, 150])
def test_fit_fields_drops_low_value_fields_first(width):
    fields = [("step", "step 1200/1500"), ("bar", "[################----] 80%"),
              ("epoch", "epoch 0 batch 1200/2199"), ("loss", "loss 1.234"),
              ("ema", "ema 1.250"), ("other", "grad_norm 0.4567"),
              ("counter", "skipped_steps 2"), ("lr", "lr 3.0e-04"),
              ("rate", "41.2 steps/s"), ("mfu", "mfu 12.0%"), ("eta", "ETA 0:00:21")]
    line = progress.fit_fields(fields, width)
    assert len(line) <= width
    for kept in ("step 1200/1500", "loss 1.234", "lr 3.0e-04", "41.2 steps/s", "ETA 0:00:21"):
        assert kept in line
    assert "grad_norm" not in line and "mfu" not in line  # the first to go
    assert ("epoch 0" in line) == (width >= 150)
    assert ("[####" in line) == (width >= 120)
    assert ("skipped_steps 2" in line) == (width >= 120)
    assert progress.fit_fields(fields, 500) == progress.join_fields(fields)
    # Narrower than the kept fields: every other field gone, then cut (never lr or rate).
    assert progress.fit_fields(fields, 60) == ("step 1200/1500 | loss 1.234 | lr 3.0e-04 | "
                                               "41.2 steps/s | E…")
    assert progress.fit_fields(fields, 20) == "step 1200/1500 | lo…"


def test_tty_bar_stops_before_the_final_line(clock):
    out = TTY()
    p = Progress(10, start_step=0, is_primary=True, stream=out, width=100)
    p.update(1, {"train/loss": 12345.0})
    p.update(2, {"train/loss": 1.0})
    p.message("eval/loss 0.5", emphasis=True)
    p.final("jtrain: done at step 2")
    p.update(3, {"train/loss": 1.0})  # after the final line: nothing
    p.close()
    p.close()
    value = out.getvalue()
    assert value.count("jtrain: done at step 2") == 1
    assert "step 2/10" not in value.split("jtrain: done at step 2")[1]
    assert "step 3/10" not in value and value.endswith("\n")
    assert value.index("eval/loss 0.5") < value.rindex("step 2/10")  # bar redrawn below


def test_non_primary_prints_nothing(capsys):
    out = TTY()
    p = Progress(10, start_step=0, is_primary=False, stream=out)
    p.update(1, {"train/loss": 1.0})
    p.message("x")
    p.close()
    p2 = Progress(10, start_step=0, is_primary=False)
    p2.update(1, {"train/loss": 1.0})
    assert out.getvalue() == "" and capsys.readouterr() == ("", "")
    p2.close()


def test_default_stream_is_stderr(capsys):
    p = Progress(4, start_step=0, is_primary=True)
    p.update(2, {"train/loss": 1.0})
    err = capsys.readouterr().err
    assert err.startswith("step 2/4 [##########----------] 50% | loss 1 | ema 1 |")
    p.close()  # a Progress left open keeps its warning handler on the "jtrain" logger,
    # writing to this test's stderr after it is closed


def test_evaluate_png_train_curve_does_not_lag(tmp_path, monkeypatch):
    """The PNG's smooth train curve: the log windows' means when logged, else a
    bias-corrected EMA that follows a falling loss (the old one started at step 1's loss
    and sat far above)."""
    from matplotlib.axes import Axes

    from jtrain.observe import plots

    drawn = {}
    real_plot = Axes.plot

    def spy(self, *args, label=None, **kw):
        if label:
            drawn[label] = [float(v) for v in args[1]]
        return real_plot(self, *args, label=label, **kw)

    monkeypatch.setattr(Axes, "plot", spy)
    old = [{"step": 10 * i, "train/loss": v} for i, v in enumerate([10, 1, 1, 1, 1, 1], 1)]
    assert plots.training_curves(old, str(tmp_path / "a.png"))
    (label, smooth), = [(k, v) for k, v in drawn.items() if "EMA" in k]
    assert label == "train (EMA 0.6, bias-corrected)" and smooth[0] == 10
    assert smooth[-1] < 1.5  # 1.29; the old curve: 0.8 ** 5 * 10 + (1 - 0.8 ** 5) = 3.95
    drawn.clear()
    new = [{**r, "train/loss_window": 2.0 + i} for i, r in enumerate(old)]
    assert plots.training_curves(new, str(tmp_path / "b.png"))
    assert drawn["train (mean of each log window)"] == [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
