"""What the run shows: redaction of secrets, and the console progress bar.

`redact` / `redact_text` (re-exported by `jtrain.writers`) clean every config, text and
line jtrain prints or writes. `Progress` draws `step 120/1000 [####----] 12% | epoch 1
batch 20/100 | loss 2.314 (ema) | lr 3.0e-04 | 41.2 steps/s | ETA 0:00:21`: redrawn in
place on a terminal, one plain line per update elsewhere; process 0 only.
"""

from __future__ import annotations

import datetime
import math
import os
import re
import shutil
import sys
import threading
import time


REDACTED = "<redacted>"

# Config keys whose (string or number) values are secrets. `token(?!s|iz)` keeps
# `max_tokens` and `tokenizer` readable; `*_key`, `apikey`, `key` etc. end in "key".
_SECRET_KEY = re.compile(
    r"(?:^|[_\-.]|api|access|private|secret|auth|client|master)key$"
    r"|token(?!s|iz)|passw(?:or)?d|secret|credential",
    re.IGNORECASE,
)
_SECRET_ENV = re.compile(r"(?:^|_)KEY$|APIKEY|TOKEN(?!IZ)|PASSWORD|PASSWD|SECRET|CREDENTIAL",
                         re.IGNORECASE)
# scheme://user:password@host -> scheme://user:<redacted>@host (the password may hold '@').
_URI_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://[^/\s:@]*):[^\s/]+@")
# Shorter environment values ("true", "1") would mask ordinary words; they are not secrets.
_MIN_ENV_SECRET_LEN = 6
# Secret strings `redact` has replaced, masked from then on in free text too: a config
# dumped into a text summary or a log line must not bring them back.
_SEEN_SECRETS: set[str] = set()
_SEEN_LOCK = threading.Lock()


def _known_secrets() -> list[str]:
    """Secret-looking environment values and secrets `redact` has seen, longest first."""
    values = {v for k, v in os.environ.items()
              if _SECRET_ENV.search(k) and len(v) >= _MIN_ENV_SECRET_LEN}
    with _SEEN_LOCK:
        values |= _SEEN_SECRETS
    return sorted(values, key=len, reverse=True)


def redact_text(s: str) -> str:
    """Masks URI passwords, secret environment values and secrets `redact` saw in `s`."""
    s = _URI_PASSWORD.sub(rf"\1:{REDACTED}@", str(s))
    for value in _known_secrets():
        s = s.replace(value, REDACTED)
    return s


def redact(tree):
    """A copy of `tree` (dicts, ConfigDicts, lists, tuples) with secrets replaced by "<redacted>".

    Values under a secret-looking key are replaced whole (bools and None are kept: they
    carry no secret) and, if strings, masked by `redact_text` from then on; every other
    string is passed through `redact_text`.
    """
    return _redact(tree, secret=False)


def _redact(node, secret: bool):
    if hasattr(node, "to_dict"):  # ml_collections ConfigDict / FrozenConfigDict
        node = node.to_dict()
    if isinstance(node, dict):
        return {k: _redact(v, secret or bool(_SECRET_KEY.search(str(k))))
                for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        items = [_redact(v, secret) for v in node]
        return items if isinstance(node, list) else tuple(items)
    if node is None or isinstance(node, bool):
        return node
    if secret:
        if isinstance(node, (str, bytes)) and len(node) >= _MIN_ENV_SECRET_LEN:
            with _SEEN_LOCK:
                _SEEN_SECRETS.add(node.decode("utf-8", "replace") if isinstance(node, bytes)
                                  else node)
        return REDACTED
    if isinstance(node, bytes):
        return redact_text(node.decode("utf-8", "replace"))
    if isinstance(node, str):
        return redact_text(node)
    return node


_clock = time.monotonic  # module attribute so tests can drive time
_BAR_WIDTH = 20
_LR_NAMES = ("lr", "learning_rate")


def _fmt(v: float) -> str:
    return f"{v:.4g}" if math.isfinite(v) else str(v)


class Progress:
    """Progress bar / log lines for the training loop.

    `update` is called on log steps with the scalars just logged: `train/*` values are
    shown EMA-smoothed (a non-finite value is shown raw and not smoothed in), the learning
    rate (`*/lr` or `*/learning_rate`) as is; steps/s is measured between updates and the
    ETA comes from it (the first rate includes start-up and compilation). `every_steps`
    is accepted for symmetry with log.every_steps; rates use the actual step deltas.
    """

    def __init__(self, total_steps: int, *, start_step: int, is_primary: bool, stream=None,
                 batches_per_epoch: int | None = None, every_steps: int = 1, ema: float = 0.9):
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"Progress: ema must be in [0, 1), got {ema}")
        self._on = is_primary
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

    def update(self, step: int, scalars: dict[str, float]) -> None:
        if not self._on or self._closed:
            return
        now = _clock()
        ds, dt = step - self._last_step, now - self._last_time
        if ds > 0 and dt > 0:
            self._rate = ds / dt
        self._last_step, self._last_time = step, now
        self._draw(self._format(step, scalars))

    def message(self, text: str) -> None:
        """Prints `text` on its own line above the bar."""
        if not self._on:
            return
        text = redact_text(text)
        if self._tty and self._line:
            self._write("\r" + " " * len(self._line) + "\r" + text + "\n" + self._line)
        else:
            self._write(text + "\n")

    def close(self) -> None:
        if self._on and not self._closed and self._tty and self._line:
            self._write("\n")
        self._closed = True

    # ------------------------------------------------------------------------------------
    def _format(self, step: int, scalars: dict[str, float]) -> str:
        frac = min(max(step / self._total, 0.0), 1.0) if self._total > 0 else 1.0
        filled = int(round(frac * _BAR_WIDTH))
        fields = [f"step {step}/{self._total} [{'#' * filled}{'-' * (_BAR_WIDTH - filled)}] "
                  f"{int(frac * 100)}%"]
        if self._bpe:
            fields.append(f"epoch {step // self._bpe} batch {step % self._bpe}/{self._bpe}")
        lr = None
        for key, value in scalars.items():
            value, name = float(value), key.rsplit("/", 1)[-1]
            if name in _LR_NAMES:
                lr = value
            elif key.startswith("train/"):
                fields.append(f"{name} {self._smooth(key, value)}"
                              + (" (ema)" if name == "loss" else ""))
        if lr is not None:
            fields.append(f"lr {lr:.1e}")
        if self._rate:
            rate = self._rate
            fields.append(f"{rate:.1f} steps/s" if rate >= 1 else f"{rate:.3g} steps/s")
            eta = max(self._total - step, 0) / rate
            fields.append(f"ETA {datetime.timedelta(seconds=int(eta))}")
        return " | ".join(fields)

    def _smooth(self, key: str, value: float) -> str:
        if not math.isfinite(value):
            return _fmt(value)
        prev = self._avg.get(key)
        self._avg[key] = value if prev is None else self._ema * prev + (1 - self._ema) * value
        return _fmt(self._avg[key])

    def _draw(self, line: str) -> None:
        line = redact_text(line)
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
