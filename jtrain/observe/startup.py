"""Where the time to the first step goes: `time_to_first_step` split into phases.

    imports       importing jtrain (jax, flax, optax, orbax, grain with it)
    distributed   the CLI's jax.distributed.initialize and the backend's start (0 for
                  the library, where that happened before train())
    data          the user's data loaded, checked, sources and the train iterator built
    build         model, mesh, optimizer, abstract state, shardings, the config checks
                  that call the model abstractly (traces; no compile)
    state         the fresh state's init (its compile included) or the restore
    writers       metric writers (TensorBoard, MLflow, W&B) and the header
    compile       the first train step: trace, compile (or cache hit), run
    other         the rest of time_to_first_step

`imports` and `distributed` happen before `train()`; the package records its import time
(jtrain/__init__.py) and the CLI its distributed init (`mark`). Each phase also counts
the compiles it holds and their persistent-cache hits (observe.compiles.Recorder).
"""

from __future__ import annotations

import contextlib
import time

PHASES = ("imports", "distributed", "data", "build", "state", "writers", "compile")

# Before train(): filled by jtrain/__init__.py and jtrain.main.
_BEFORE: dict[str, float] = {}


def mark(phase: str, seconds: float) -> None:
    """A phase that ran before train() in this process (imports, distributed)."""
    _BEFORE[phase] = _BEFORE.get(phase, 0.0) + seconds


class Startup:
    """Phase timings of this process's start-up; `recorder` (observe.compiles.Recorder)
    adds compile counts. Also what the first step needs from the start-up: `cache_dir`
    (the persistent compilation cache, None = off) and `precompile` (the thread that
    compiles the train step ahead, if any)."""

    def __init__(self, recorder=None):
        self._recorder = self.recorder = recorder
        self.cache_dir: str | None = None
        self.precompile = None  # threading.Thread
        self.seconds: dict[str, float] = {p: _BEFORE.get(p, 0.0) for p in PHASES}
        self.compiles: dict[str, tuple[int, int]] = {}  # phase -> (compiles, cache hits)
        self._t0 = time.perf_counter()
        self.total: float | None = None

    @contextlib.contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        before = self._recorder.snapshot() if self._recorder else None
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
            if before is not None:
                after = self._recorder.snapshot()
                n, h = self.compiles.get(name, (0, 0))
                self.compiles[name] = (n + after[0] - before[0], h + after[1] - before[1])

    def first_step(self) -> float:
        """Call when the first step's result is ready: fixes time_to_first_step (from
        train() plus the phases before it)."""
        if self.total is None:
            self.total = (time.perf_counter() - self._t0 + self.seconds["imports"]
                          + self.seconds["distributed"])
        return self.total

    def breakdown(self) -> dict[str, float]:
        """{"startup/<phase>_sec": s, ..., "perf/time_to_first_step_sec": total}."""
        out = {f"startup/{p}_sec": round(self.seconds[p], 3) for p in PHASES}
        if self.total is not None:
            out["startup/other_sec"] = round(max(self.total - sum(self.seconds.values()),
                                                 0.0), 3)
            out["perf/time_to_first_step_sec"] = round(self.total, 3)
        return out

    def line(self, cache_dir: str | None) -> str:
        """The header's start-up line, printed once the first step is done."""
        parts = []
        for p in PHASES:
            s = f"{p} {self.seconds[p]:.2f}"
            n, hits = self.compiles.get(p, (0, 0))
            if n:
                s += f" ({n} compile{'s' if n > 1 else ''}, {hits} cached)"
            parts.append(s)
        cache = f"compile cache {cache_dir}" if cache_dir else "compile cache off"
        return (f"jtrain: first step after {self.total or 0.0:.2f} s: "
                + ", ".join(parts) + f" s; {cache}")
