"""The console: `Progress` draws `step 120/1000 [####----] 12% | epoch 1 batch 20/100 |
loss 2.314 (ema) | lr 3.0e-04 | 41.2 steps/s | ETA 0:00:21`: redrawn in place on a
terminal, one plain line per update elsewhere; process 0 only. It also keeps
WORKDIR/train.log and shows each distinct warning once.
"""

from __future__ import annotations

import datetime
import logging
import math
import shutil
import sys
import time
import warnings

from jtrain.observe.redact import redact_text


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
LOG_FILE = "train.log"


def _fmt(v: float) -> str:
    return f"{v:.4g}" if math.isfinite(v) else str(v)


class Progress:
    """Progress bar / log lines for the training loop, the log file, and warnings.

    `update` is called on log steps with the scalars just logged: `train/*` values are
    shown EMA-smoothed (a non-finite value is shown raw and not smoothed in; counters such
    as skipped_steps only when non-zero), the learning rate (`*/lr` or `*/learning_rate`)
    as is, `perf/mfu` as a percentage; steps/s is measured between updates and the ETA
    comes from it (the first rate includes start-up and compilation). `every_steps` is
    accepted for symmetry with log.every_steps; rates use the actual step deltas.

    Verbosity (log.verbosity): 0 prints only level-0 messages (errors, the final summary);
    1 adds the header, progress lines, eval lines and warnings; 2 adds debug messages
    (parameter table, timings, memory). `log_path` gets every line at level <= max(1,
    verbosity), time-stamped, plain (no bar redraws), plus each distinct warning once.
    Only the primary process prints and writes; with `all_hosts` the others print too,
    prefixed with their process index. While open, Python warnings and the "jtrain"
    logger go through `warning` (deduplicated); on quiet processes they are dropped.
    """

    def __init__(self, total_steps: int, *, start_step: int, is_primary: bool, stream=None,
                 batches_per_epoch: int | None = None, every_steps: int = 1, ema: float = 0.9,
                 verbosity: int = 1, log_path: str | None = None, all_hosts: bool = False,
                 process_index: int = 0):
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"Progress: ema must be in [0, 1), got {ema}")
        self._on = bool(is_primary or all_hosts)
        self._prefix = "" if is_primary else f"[process {process_index}] "
        self._verbosity = int(verbosity)
        self._stream = sys.stderr if stream is None else stream
        isatty = getattr(self._stream, "isatty", None)
        self._tty = bool(isatty and isatty())
        self._total = int(total_steps)
        self._bpe = batches_per_epoch or None
        self._every = max(1, int(every_steps))
        self._ema = ema
        self._avg: dict[str, float] = {}
        self._last_step, self._last_time = int(start_step), _clock()
        self._rate: float | None = None
        self._line = ""  # the bar currently on screen (TTY)
        self._closed = False
        self._file = None
        if log_path and is_primary:
            self._file = open(log_path, "a", encoding="utf-8")
        self._seen_warnings: dict[str, int] = {}
        self._capture_warnings()

    @property
    def batches_per_epoch(self) -> int | None:
        return self._bpe

    @batches_per_epoch.setter
    def batches_per_epoch(self, value: int | None) -> None:
        self._bpe = value or None

    def update(self, step: int, scalars: dict[str, float]) -> None:
        if self._closed:
            return
        now = _clock()
        ds, dt = step - self._last_step, now - self._last_time
        if ds > 0 and dt > 0:
            self._rate = ds / dt
        self._last_step, self._last_time = step, now
        if not (self._on or self._file):
            return
        line = redact_text(self._format(step, scalars))
        self._log(line)
        if self._on and self._verbosity >= 1:
            self._draw(self._prefix + line)

    def message(self, text: str, level: int = 1) -> None:
        """Prints `text` on its own line above the bar if `level` <= verbosity; logs it
        if `level` <= max(1, verbosity)."""
        if self._closed:
            return
        text = redact_text(text)
        if level <= max(1, self._verbosity):
            self._log(text)
        if not self._on or level > self._verbosity:
            return
        text = "\n".join(self._prefix + t for t in text.split("\n"))
        if self._tty and self._line:
            self._write("\r" + " " * len(self._line) + "\r" + text + "\n" + self._line)
        else:
            self._write(text + "\n")

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
        if self._on and self._tty and self._line:
            self._write("\n")
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
    def _format(self, step: int, scalars: dict[str, float]) -> str:
        frac = min(max(step / self._total, 0.0), 1.0) if self._total > 0 else 1.0
        filled = int(round(frac * _BAR_WIDTH))
        fields = [f"step {step}/{self._total} [{'#' * filled}{'-' * (_BAR_WIDTH - filled)}] "
                  f"{int(frac * 100)}%"]
        if self._bpe and step > 0:
            fields.append(f"epoch {(step - 1) // self._bpe} "
                          f"batch {(step - 1) % self._bpe + 1}/{self._bpe}")
        lr = mfu = None
        rate = scalars.get("perf/steps_per_sec", self._rate)  # training only, if measured
        # The loss first, then the other train/* values in the order given.
        for key, value in sorted(scalars.items(), key=lambda kv: kv[0] != "train/loss"):
            value, name = float(value), key.rsplit("/", 1)[-1]
            if name in _LR_NAMES:
                lr = value
            elif key == "perf/mfu":
                mfu = value
            elif key.startswith("train/") and not (name in _COUNTERS and value == 0):
                fields.append(f"{name} {self._smooth(key, value)}"
                              + (" (ema)" if name == "loss" else ""))
        if lr is not None:
            fields.append(f"lr {lr:.1e}")
        if rate:
            fields.append(f"{rate:.1f} steps/s" if rate >= 1 else f"{rate:.3g} steps/s")
        if mfu is not None and math.isfinite(mfu):
            fields.append(f"mfu {100 * mfu:.1f}%")
        if self._rate:  # wall clock between updates: evaluations included
            eta = max(self._total - step, 0) / self._rate
            fields.append(f"ETA {datetime.timedelta(seconds=int(eta))}")
        return " | ".join(fields)

    def _smooth(self, key: str, value: float) -> str:
        if not math.isfinite(value) or key.rsplit("/", 1)[-1] in _COUNTERS:
            return _fmt(value)
        prev = self._avg.get(key)
        self._avg[key] = value if prev is None else self._ema * prev + (1 - self._ema) * value
        return _fmt(self._avg[key])

    def _draw(self, line: str) -> None:
        if not self._tty:
            self._write(line + "\n")
            return
        # A wrapped line cannot be redrawn with \r: keep it within the terminal.
        line = line[: max(20, shutil.get_terminal_size((120, 24)).columns - 1)]
        self._write("\r" + line + " " * max(0, len(self._line) - len(line)))
        self._line = line

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
