"""`python -m jtrain.bench console`: what the progress line costs per update.

The same `Progress.update` loop (the scalars of a log step) drawn two ways, interleaved
round by round in one process: rich's bar on a pseudo-terminal of `--columns` (what a
person at a terminal gets; a thread drains the terminal like a terminal emulator would)
and plain lines into /dev/null (files, pipes, CI). It prints the microseconds per update
of each side and their ratio. An update happens once per log step (`log.every_steps`),
so the difference is paid once per log step, not per training step.
"""

from __future__ import annotations

import os
import statistics
import threading
import time

from jtrain.observe import console

_SCALARS = {"train/loss": 2.0, "train/loss_window": 2.1, "train/grad_norm": 0.5,
            "train/lr": 3e-3, "perf/steps_per_sec": 40.0}


def _per_update_us(stream, updates: int, columns: int | None) -> float:
    p = console.Progress(10**9, start_step=0, is_primary=True, stream=stream,
                         batches_per_epoch=2199, width=columns)
    p.update(1, _SCALARS)  # the first draw imports rich: not timed
    t0 = time.perf_counter()
    for step in range(2, updates + 2):
        p.update(step, _SCALARS)
    elapsed = time.perf_counter() - t0
    p.close()
    return 1e6 * elapsed / updates


def run(*, updates: int, rounds: int, columns: int) -> dict:
    master, slave = os.openpty()
    tty = os.fdopen(slave, "w")

    def drain():
        while True:
            try:
                if not os.read(master, 65536):
                    return
            except OSError:
                return

    threading.Thread(target=drain, daemon=True).start()
    rich_us, plain_us = [], []
    with open(os.devnull, "w") as devnull:
        for _ in range(rounds):
            rich_us.append(_per_update_us(tty, updates, columns))
            plain_us.append(_per_update_us(devnull, updates, None))
    tty.close()
    os.close(master)
    return {"updates": updates, "rounds": rounds, "columns": columns,
            "rich_us": rich_us, "plain_us": plain_us,
            "ratio": statistics.median(rich_us) / statistics.median(plain_us)}


def format_report(res: dict) -> str:
    lines = [f"console: {res['rounds']} rounds x {res['updates']} updates, terminal "
             f"{res['columns']} columns",
             f"{'round':>6} {'rich pty us':>12} {'plain us':>9}"]
    for i, (r, p) in enumerate(zip(res["rich_us"], res["plain_us"], strict=True)):
        lines.append(f"{i + 1:>6} {r:>12.0f} {p:>9.0f}")
    lines.append(f"console: rich bar {statistics.median(res['rich_us']):.0f} us/update, plain "
                 f"line {statistics.median(res['plain_us']):.0f} us/update (medians), ratio "
                 f"{res['ratio']:.2f}; paid once per log step")
    return "\n".join(lines)
