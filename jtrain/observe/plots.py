"""PNG plots for `python -m jtrain.evaluate`: training curves, a confusion matrix and
goodput.png (where the run's time went, per session); and a population run's
population.png (every member's curves, their mean, the winner).

matplotlib with the Agg backend (no display needed), imported only when plotting.
"""

from __future__ import annotations

import io
import json

import numpy as np

from jtrain.observe import layout
from jtrain.observe.console import EMA

# The eval panel shows the first of these the run logged.
_EVAL_PANEL = ("eval/accuracy", "eval/r2", "eval/bits_per_byte", "eval/perplexity", "eval/mse")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str, **kwargs) -> None:
    """The figure as a PNG at `path`, written whole through a temporary file beside it
    (layout.write_file): a symlink planted at `path` in a run is replaced, not written
    through."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", **kwargs)
    layout.write_file(path, buf.getvalue())


def _series(records: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of `key`; a step logged twice (a resumed run) keeps its last value."""
    by_step = {}
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and "step" in r:
            by_step[int(r["step"])] = float(v)
    steps = np.array(sorted(by_step), dtype=np.int64)
    return steps, np.array([by_step[s] for s in steps], dtype=np.float64)


def training_curves(records: list[dict], path: str) -> bool:
    """Loss (train, smoothed, and eval), learning rate, an eval metric and steps/s against
    the step, from metrics.jsonl records. False (and no file) when there is no train/loss."""
    train_steps, train_loss = _series(records, "train/loss")
    if len(train_steps) == 0:
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    ax = axes[0, 0]
    ax.plot(train_steps, train_loss, color="tab:blue", alpha=0.35, lw=1, label="train (raw)")
    window_steps, window_loss = _series(records, "train/loss_window")
    if len(window_steps):  # the mean over each log window: what the progress bar showed
        ax.plot(window_steps, window_loss, color="tab:blue", lw=2,
                label="train (mean of each log window)")
    elif len(train_loss) >= 5:  # older runs: a bias-corrected EMA, not started at step 1's
        ema = EMA(0.6)  # loss (which made the curve lag far above the eval loss)
        smooth = [ema.add(v) for v in train_loss]
        ax.plot(train_steps, [np.nan if v is None else v for v in smooth], color="tab:blue",
                lw=2, label="train (EMA 0.6, bias-corrected)")
    eval_steps, eval_loss = _series(records, "eval/loss")
    if len(eval_steps):
        ax.plot(eval_steps, eval_loss, "o-", color="tab:orange", lw=2, label="eval")
    ax.set(title="loss", xlabel="step", ylabel="loss")
    ax.legend()
    _line(axes[0, 1], *_series(records, "train/lr"), "learning rate", "lr")
    key = next((k for k in _EVAL_PANEL if len(_series(records, k)[0])), None)
    if key:
        _line(axes[1, 0], *_series(records, key), key, key.split("/", 1)[1], marker="o",
              color="tab:green")
    else:
        axes[1, 0].set_axis_off()
    _line(axes[1, 1], *_series(records, "perf/steps_per_sec"), "throughput", "steps / s",
          color="tab:purple")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.suptitle(f"training curves ({len(train_steps)} log steps, last step {train_steps[-1]})")
    save(fig, path, dpi=100)
    plt.close(fig)
    return True


def _line(ax, steps, values, title, ylabel, marker=None, color="tab:blue"):
    if len(steps) == 0:
        ax.set_axis_off()
        return
    ax.plot(steps, values, marker=marker, color=color, lw=1.5)
    ax.set(title=title, xlabel="step", ylabel=ylabel)


def _count_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


def confusion_matrix(counts: np.ndarray, path: str, title: str = "confusion matrix") -> None:
    """Rows = true class, columns = predicted; colour = share of the row, text = counts
    (summed example weights, which need not be whole; for up to 20 classes)."""
    counts = np.asarray(counts, np.float64)
    c = counts.shape[0]
    rows = counts.sum(axis=1, keepdims=True)
    share = np.where(rows > 0, counts / np.maximum(rows, 1), 0.0)
    plt = _pyplot()
    size = min(3 + 0.45 * c, 14)
    fig, ax = plt.subplots(figsize=(size + 1.5, size), constrained_layout=True)
    im = ax.imshow(share, cmap="Blues", vmin=0.0, vmax=1.0)
    fig.colorbar(im, ax=ax, label="share of the true class")
    if c <= 20:
        for i in range(c):
            for j in range(c):
                ax.text(j, i, _count_text(counts[i, j]), ha="center", va="center", fontsize=9,
                        color="white" if share[i, j] > 0.5 else "black")
        ax.set_xticks(range(c))
        ax.set_yticks(range(c))
    ax.set(title=title, xlabel="predicted class", ylabel="true class")
    save(fig, path, dpi=100)
    plt.close(fig)


def population_curves(records: list[dict], path: str, size: int,
                      winners: dict[str, int]) -> bool:
    """One panel per metric logged per member (`<name>/m<i>`; per-class metrics such as
    `eval/f1/0` and an all-zero `train/skipped_steps` left out): each member's curve in
    its own colour, the mean over the members (`<name>`, dashed) and the winner
    (`winners[name]`, when given) drawn bold with a star at its last point. False (and no
    file) when no metric has per-member values."""
    names = sorted({k[:-3] for r in records for k in r if k.endswith("/m0")
                    and k.startswith(("train/", "eval/")) and not k[:-3].split("/")[-1].isdigit()})
    names = [n for n in names if n != "train/skipped_steps"
             or any(_series(records, f"{n}/m{i}")[1].any() for i in range(size))]
    if not names:
        return False
    plt = _pyplot()
    colors = plt.get_cmap("tab10" if size <= 10 else "viridis")
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.4 * rows),
                             constrained_layout=True, squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):  # the grid may have spare axes
        best = winners.get(name)
        marker = "o" if name.startswith("eval/") else None
        for i in range(size):
            steps, values = _series(records, f"{name}/m{i}")
            color = colors(i % 10 if size <= 10 else i / max(size - 1, 1))
            win = i == best
            label = (f"m{i} (winner)" if win else f"m{i}") if size <= 10 or win else None
            ax.plot(steps, values, marker=marker, color=color, lw=2.5 if win else 1,
                    alpha=1.0 if win else 0.6, label=label)
            if win and len(steps):
                ax.plot(steps[-1:], values[-1:], "*", color=color, markersize=14)
        ax.plot(*_series(records, name), "--", color="black", lw=1.5, label="mean")
        ax.set(title=name, xlabel="step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(names):]:
        ax.set_axis_off()
    fig.suptitle(f"population of {size} members (winner: best last value; lower is better "
                 "for losses)")
    save(fig, path, dpi=80)
    plt.close(fig)
    return True


def goodput_bars(rows: list[dict], path: str) -> dict:
    """goodput.png: one stacked bar per session of its seconds by category
    (`observe.goodput.sessions(records)`; the restart gap before a session is part of
    its bar). The numbers drawn go into the PNG's "goodput" text field as JSON (what a
    reader or a test checks against goodput.jsonl); returned as well."""
    from jtrain.observe import goodput

    drawn = {"sessions": [{k: round(r["seconds"][k], 6) for k in goodput.SESSION_KEYS}
                          for r in rows]}
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(2.0 + 0.9 * len(rows), 4.5), constrained_layout=True)
    colors = plt.get_cmap("tab10")
    bottom = np.zeros(len(rows))
    x = np.arange(1, len(rows) + 1)
    for i, key in enumerate(goodput.SESSION_KEYS):
        values = np.array([s[key] for s in drawn["sessions"]], dtype=np.float64)
        if not values.any():
            continue
        ax.bar(x, values, bottom=bottom, color=colors(i), label=key.replace("_", " "))
        bottom += np.clip(values, 0, None)
    total = sum(map(sum, (s.values() for s in drawn["sessions"])))
    productive = sum(s["productive"] for s in drawn["sessions"])
    ax.set(xlabel="session", ylabel="seconds", xticks=x,
           title=f"goodput {100 * productive / total if total > 0 else 0:.1f}% of "
                 f"{total:.1f} s")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    save(fig, path, dpi=80, metadata={"goodput": json.dumps(drawn)})
    plt.close(fig)
    return drawn
