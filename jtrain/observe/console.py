"""The console: `Progress` draws `step 120/1000 [####----] 12% | epoch 1 batch 20/100 |
loss 2.314 | ema 2.30 | lr 3.0e-04 | 41.2 steps/s | ETA 0:00:21`: redrawn in place on a
terminal (rich), fitted to its width, one plain line per update elsewhere; process 0
only. It also keeps WORKDIR/train.log and shows each distinct warning once.
"""

from __future__ import annotations

import datetime
import logging
import math
import sys
import time
import warnings

from jtrain.redact import redact_text
from jtrain.observe import layout


def say(line: str) -> None:
    """One line on stderr from process 0 (warnings, restore notes), outside `Progress`."""
    import jax

    if jax.process_index() == 0:
        sys.stderr.write(redact_text(f"jtrain: {line}") + "\n")
        sys.stderr.flush()


_clock = time.monotonic  # module attribute so tests can drive time
_BAR_WIDTH = 20
_LR_NAMES = ("lr", "learning_rate")
_COUNTERS = ("skipped_steps",)  # shown only when non-zero
_WINDOW_KEY = "train/loss_window"  # the mean loss of the log window (loop._drain)
LOG_FILE = "train.log"

# Fields of the progress line, most important first: when the line is wider than the
# terminal, fields are dropped from the end of this order (step/total, loss, lr, rate and
# ETA are never dropped; the line is cut only if they alone do not fit).
_DROP_ORDER = ("other", "mfu", "ema", "epoch", "bar", "counter")


def _fmt(v: float) -> str:
    return f"{v:.4g}" if math.isfinite(v) else str(v)


class EMA:
    """A bias-corrected exponential moving average (Adam's correction): the first value
    counts fully, not as a start the average has to climb down from. Non-finite values are
    not taken in. `horizon` ~ 1 / (1 - decay) values."""

    def __init__(self, decay: float):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.decay, self._m, self._n = decay, 0.0, 0

    def add(self, value: float) -> float | None:
        if math.isfinite(value):
            self._m = self.decay * self._m + (1.0 - self.decay) * value
            self._n += 1
        return self.value

    @property
    def value(self) -> float | None:
        return self._m / (1.0 - self.decay ** self._n) if self._n else None


def fit_fields(fields: list[tuple[str, str]], width: int) -> str:
    """Joins `(kind, text)` fields with " | ", dropping fields by `_DROP_ORDER` (the last
    of a kind first) until the line fits in `width` columns; then cuts it."""
    fields = list(fields)
    for kind in _DROP_ORDER:
        while len(join_fields(fields)) > width and any(k == kind for k, _ in fields):
            last = max(i for i, (k, _) in enumerate(fields) if k == kind)
            del fields[last]
    line = join_fields(fields)
    return line if len(line) <= width else line[: max(1, width - 1)] + "…"


def join_fields(fields: list[tuple[str, str]]) -> str:
    """`step 12/100 [##--] 12% | loss 2.3 | ...`: the bar follows the step count."""
    return "".join((" " if kind == "bar" else " | ") * (i > 0) + text
                   for i, (kind, text) in enumerate(fields))


class Progress:
    """Progress bar / log lines for the training loop, the log file, and warnings.

    `update` is called on log steps with the scalars just logged. The loss shown is the
    mean train loss over the log window (`train/loss_window`, exactly what metrics.jsonl
    records for that step; `train/loss` when no window mean is given), and `ema` a
    bias-corrected moving average of those means with decay `ema` (short: about
    1/(1-ema) log steps). Other `train/*` values are shown as logged (counters such as
    skipped_steps only when non-zero), the learning rate (`*/lr` or `*/learning_rate`),
    `perf/mfu` as a percentage; steps/s is measured between updates and the ETA comes
    from it (the first rate includes start-up and compilation).

    On a terminal the bar is one line redrawn in place by rich (`rich.live.Live`, no
    refresh thread: it is drawn only on updates), fitted to the terminal's width by
    dropping low-value fields first (`fit_fields`); messages print above it, eval lines
    in bold. `final(text)` stops the bar for good, then prints the run's last line: the
    bar is never redrawn after it. Elsewhere (a file, a pipe) one plain line per update.

    Verbosity (log.verbosity): 0 prints only level-0 messages (errors, the final summary);
    1 adds the header, progress lines, eval lines and warnings; 2 adds debug messages
    (parameter table, timings, memory). `log_path` gets every line at level <= max(1,
    verbosity), time-stamped, plain, plus each distinct warning once. Only the primary
    process prints and writes; with `all_hosts` the others print too, prefixed with their
    process index. While open, Python warnings and the "jtrain" logger go through
    `warning` (deduplicated); on quiet processes they are dropped.
    """

    def __init__(self, total_steps: int, *, start_step: int, is_primary: bool, stream=None,
                 batches_per_epoch: int | None = None, every_steps: int = 1, ema: float = 0.5,
                 verbosity: int = 1, log_path: str | None = None, all_hosts: bool = False,
                 process_index: int = 0, width: int | None = None):
        self._on = bool(is_primary or all_hosts)
        self._prefix = "" if is_primary else f"[process {process_index}] "
        self._verbosity = int(verbosity)
        self._stream = sys.stderr if stream is None else stream
        isatty = getattr(self._stream, "isatty", None)
        self._tty = bool(isatty and isatty())
        self._width = width  # None: the terminal's (rich asks the terminal, or $COLUMNS)
        self._console = self._live = None
        self._total = int(total_steps)
        self._bpe = batches_per_epoch or None
        self._every = max(1, int(every_steps))
        self._ema = EMA(ema)
        self._last_step, self._last_time = int(start_step), _clock()
        self._rate: float | None = None
        self._finished = self._closed = False
        self._file = None
        if log_path and is_primary:
            self._file = layout.open_append(log_path)
        self._seen_warnings: dict[str, int] = {}
        self._capture_warnings()

    @property
    def batches_per_epoch(self) -> int | None:
        return self._bpe

    @batches_per_epoch.setter
    def batches_per_epoch(self, value: int | None) -> None:
        self._bpe = value or None

    def update(self, step: int, scalars: dict[str, float]) -> None:
        if self._closed or self._finished:
            return
        now = _clock()
        ds, dt = step - self._last_step, now - self._last_time
        if ds > 0 and dt > 0:
            self._rate = ds / dt
        self._last_step, self._last_time = step, now
        if not (self._on or self._file):
            return
        fields = self._fields(step, scalars)
        self._log(redact_text(join_fields(fields)))
        if self._on and self._verbosity >= 1:
            if self._tty:
                width = self._terminal_width() - len(self._prefix) - 1
                self._draw(self._prefix + redact_text(fit_fields(fields, max(20, width))))
            else:
                self._write(self._prefix + redact_text(join_fields(fields)) + "\n")

    def message(self, text: str, level: int = 1, emphasis: bool = False) -> None:
        """Prints `text` on its own line above the bar if `level` <= verbosity (bold on a
        terminal with `emphasis`: eval lines); logs it if `level` <= max(1, verbosity)."""
        if self._closed:
            return
        text = redact_text(text)
        if level <= max(1, self._verbosity):
            self._log(text)
        if not self._on or level > self._verbosity:
            return
        text = "\n".join(self._prefix + t for t in text.split("\n"))
        if self._tty:
            from rich.text import Text

            self._rich().print(Text(text, style="bold" if emphasis else ""), soft_wrap=True)
        else:
            self._write(text + "\n")

    def final(self, text: str) -> None:
        """The run's last line (level 0): the bar stops first and is not drawn again."""
        self._stop_bar()
        self._finished = True
        self.message(text, level=0)

    def record(self, text: str) -> None:
        """`text` into train.log only (a line that the CLI prints itself, e.g. an error)."""
        if not self._closed:
            self._log(redact_text(text))

    def warning(self, text: str) -> None:
        """A warning at level 1, printed and logged once per distinct text."""
        text = str(text).strip()
        count = self._seen_warnings.get(text, 0)
        self._seen_warnings[text] = count + 1
        if count == 0:
            self.message(f"jtrain: warning: {text}", level=1)

    def close(self) -> None:
        if self._closed:
            return
        self._stop_bar()
        for text, count in self._seen_warnings.items():
            if count > 1:
                self._log(redact_text(f"jtrain: warning repeated {count} times: {text}"))
        self._closed = True
        self._release_warnings()
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- warnings ---------------------------------------------------------------------------
    def _capture_warnings(self) -> None:
        quiet = not (self._on or self._file)

        def show(message, category, filename, lineno, file=None, line=None):
            if not quiet and not self._closed:
                self.warning(f"{category.__name__}: {message}")

        self._old_showwarning = warnings.showwarning
        warnings.showwarning = show
        self._logger = logging.getLogger("jtrain")
        self._old_propagate = self._logger.propagate
        self._handler = _WarningHandler(None if quiet else self)
        self._logger.addHandler(self._handler)
        self._logger.propagate = False

    def _release_warnings(self) -> None:
        warnings.showwarning = self._old_showwarning
        self._logger.removeHandler(self._handler)
        self._logger.propagate = self._old_propagate

    # -- formatting ---------------------------------------------------------------------
    def _fields(self, step: int, scalars: dict[str, float]) -> list[tuple[str, str]]:
        frac = min(max(step / self._total, 0.0), 1.0) if self._total > 0 else 1.0
        filled = int(round(frac * _BAR_WIDTH))
        fields = [("step", f"step {step}/{self._total}"),
                  ("bar", f"[{'#' * filled}{'-' * (_BAR_WIDTH - filled)}] {int(frac * 100)}%")]
        if self._bpe and step > 0:
            fields.append(("epoch", f"epoch {(step - 1) // self._bpe} "
                                    f"batch {(step - 1) % self._bpe + 1}/{self._bpe}"))
        loss = scalars.get(_WINDOW_KEY, scalars.get("train/loss"))
        if loss is not None:
            fields.append(("loss", f"loss {_fmt(float(loss))}"))
            smooth = self._ema.add(float(loss))
            if smooth is not None:
                fields.append(("ema", f"ema {_fmt(smooth)}"))
        lr = mfu = None
        rate = scalars.get("perf/steps_per_sec", self._rate)  # training only, if measured
        for key, value in scalars.items():
            value, name = float(value), key.rsplit("/", 1)[-1]
            if name in _LR_NAMES:
                lr = value
            elif key == "perf/mfu":
                mfu = value
            elif key in ("train/loss", _WINDOW_KEY) or not key.startswith("train/") \
                    or key.count("/") > 1:  # per-class train metrics: metrics.jsonl only
                continue
            elif name in _COUNTERS:
                if value:
                    fields.append(("counter", f"{name} {_fmt(value)}"))
            else:
                fields.append(("other", f"{name} {_fmt(value)}"))
        if lr is not None:
            fields.append(("lr", f"lr {lr:.1e}"))
        if rate:
            fields.append(("rate", f"{rate:.1f} steps/s" if rate >= 1 else
                                   f"{rate:.3g} steps/s"))
        if mfu is not None and math.isfinite(mfu):
            fields.append(("mfu", f"mfu {100 * mfu:.1f}%"))
        if self._rate:  # wall clock between updates: evaluations included
            eta = max(self._total - step, 0) / self._rate
            fields.append(("eta", f"ETA {datetime.timedelta(seconds=int(eta))}"))
        return fields

    # -- the terminal (rich) ------------------------------------------------------------
    def _rich(self):
        if self._console is None:
            from rich.console import Console

            self._console = Console(file=self._stream, width=self._width, highlight=False,
                                    markup=False, emoji=False)
        return self._console

    def _terminal_width(self) -> int:
        return self._rich().width

    def _draw(self, line: str) -> None:
        from rich.text import Text

        if self._live is None:
            from rich.live import Live

            self._live = Live(console=self._rich(), auto_refresh=False, transient=False,
                              redirect_stdout=False, redirect_stderr=False)
            self._live.start()
        self._live.update(Text(line, no_wrap=True, overflow="ellipsis"), refresh=True)

    def _stop_bar(self) -> None:
        if self._live is not None:
            self._live.stop()  # leaves the last bar on screen, the cursor below it
            self._live = None

    def _write(self, s: str) -> None:
        self._stream.write(s)
        self._stream.flush()

    def _log(self, text: str) -> None:
        if self._file is None:
            return
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        self._file.write("".join(f"{stamp} {t}\n" for t in text.split("\n")))
        self._file.flush()


class _WarningHandler(logging.Handler):
    """Routes the "jtrain" logger's records (warnings and up) to Progress.warning."""

    def __init__(self, progress: Progress | None):
        super().__init__(level=logging.WARNING)
        self._progress = progress

    def emit(self, record):
        if self._progress is not None:
            self._progress.warning(record.getMessage())
