"""Performance metrics and profiling. Reads `config.perf` and `config.profile`.

`Meter` turns host timestamps into `perf/*` scalars on each log step:

  perf/steps_per_sec, perf/examples_per_sec, perf/tokens_per_sec   since the last log step,
                       not counting time spent in evaluation
  perf/data_wait_frac  share of wall time the loop spent getting the next batch (grain +
                       host-to-device copy); high means the input pipeline is the bottleneck
  perf/mfu             model FLOPs utilisation = flops_per_example * examples/s
                       / (peak FLOP/s per device * devices), when both are known
  perf/compile_sec     once: the first train_step call (trace + compile + dispatch)
  perf/time_to_first_step_sec  once: from `train()` to the first step's result

FLOPs per example are a number `build()` hands in (`Build.flops_per_example`: the
built-in family's formula, the transformer's (6N + 12*L*d*T)*T after Kaplan et al. 2020,
or a user model's `flops_per_example` attribute: a number or a function of one example's
input shape).
The peak is `perf.peak_flops` if set, else the dense bf16 tensor-core peak of the device
from `PEAK_FLOPS` (vendor datasheets; MFU is quoted against it whatever the compute
dtype); unknown devices and CPUs get no MFU unless `perf.peak_flops` is set.

`Profiler` writes a `jax.profiler` trace of steps [profile.start_step, + num_steps) to
WORKDIR/profile (TensorBoard's profile plugin reads it) on process 0.
"""

from __future__ import annotations

import os
import resource
import time

import jax

# Dense bf16 peak FLOP/s per device (no sparsity), by device_kind substring, most specific
# first. GPUs: the SXM parts' numbers.
PEAK_FLOPS = (
    ("H200", 989e12), ("H100", 989e12), ("GH200", 989e12), ("B200", 2250e12),
    ("A100", 312e12), ("L40S", 362e12), ("L4", 121e12), ("A10", 125e12),
    ("V100", 125e12), ("RTX 4090", 165e12), ("TPU v6", 918e12), ("TPU v5p", 459e12),
    ("TPU v5 lite", 197e12), ("TPU v5e", 197e12), ("TPU v4", 275e12), ("TPU v3", 123e12),
)


def peak_flops_per_device(configured: float = 0.0, device=None) -> float | None:
    """`configured` if > 0, else the table's value for the device kind, else None."""
    if configured and configured > 0:
        return float(configured)
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return None
    kind = device.device_kind
    for name, flops in PEAK_FLOPS:
        if name.lower() in kind.lower():
            return flops
    return None


class Meter:
    """Host-side timings of the training loop; `log_values` on each log step.

    The interval between two log steps is the longer of (a) the time between fetching
    their metrics and (b) the time between dispatching them. Each alone undercounts:
    (b) while the queue of steps in flight fills (dispatch runs ahead of the device), (a)
    when fetches bunch up (the last steps of a run, drained back to back, or a backend
    that executes during dispatch). Time spent in `add` (evaluation) is left out."""

    def __init__(self, *, start_step: int, global_batch: int, flops_per_example: float | None,
                 peak_flops: float | None, num_devices: int, t_start: float):
        self._batch = global_batch
        self._flops = flops_per_example
        self._peak_total = peak_flops * num_devices if peak_flops else None
        self._t_start = t_start
        self._first: dict[str, float] = {}
        self._once_written = False
        self._totals = {"data": 0.0, "dispatch": 0.0, "eval": 0.0}
        self._data = self._excluded = 0.0  # cumulative data wait / time outside steps
        # step -> (dispatch time, cumulative data wait, cumulative excluded) at dispatch
        self._marks: dict[int, tuple[float, float, float]] = {}
        now = time.perf_counter()
        self._last = (start_step, now, 0.0, 0.0, now, 0.0)  # + fetch time, excluded then
        self._intervals: list[tuple[int, float]] = []  # (steps, seconds) per log interval

    def step_done(self, step: int, data_sec: float, dispatch_sec: float, metrics=None) -> None:
        """After each train_step call: the time to get its batch and to dispatch it. On the
        first call, blocks on `metrics` once to time compilation and the first step."""
        self._data += data_sec
        self._totals["data"] += data_sec
        self._totals["dispatch"] += dispatch_sec
        if not self._first and metrics is not None:
            self._first["perf/compile_sec"] = dispatch_sec
            jax.block_until_ready(metrics)
            self._first["perf/time_to_first_step_sec"] = time.perf_counter() - self._t_start
        self._marks[step] = (time.perf_counter(), self._data, self._excluded)

    def set_first(self, values: dict[str, float]) -> None:
        """The start-up breakdown (observe.startup): written with the first log step
        and kept in the summary; its time_to_first_step replaces the Meter's own."""
        self._first.update(values)

    def add(self, component: str, seconds: float) -> None:
        """Time spent outside steps (eval, checkpoint), for the verbosity-2 timings;
        not counted in the step rates."""
        self._totals[component] = self._totals.get(component, 0.0) + seconds
        self._excluded += seconds

    def log_values(self, step: int, tokens: float) -> dict[str, float]:
        """perf/* scalars for the steps since the previous call (`step` was dispatched)."""
        now = time.perf_counter()
        t, data, excluded = self._marks.get(step) or (now, self._data, self._excluded)
        for k in [k for k in self._marks if k <= step]:
            del self._marks[k]
        last_step, last_t, last_data, last_excluded, last_now, last_now_excluded = self._last
        dt = max(t - last_t - (excluded - last_excluded),
                 now - last_now - (self._excluded - last_now_excluded), 1e-9)
        rate = (step - last_step) / dt
        self._intervals.append((step - last_step, dt))
        values = {"perf/steps_per_sec": rate,
                  "perf/examples_per_sec": rate * self._batch,
                  "perf/tokens_per_sec": rate * tokens,
                  "perf/data_wait_frac": min((data - last_data) / dt, 1.0)}
        if self._flops and self._peak_total:
            values["perf/mfu"] = self._flops * rate * self._batch / self._peak_total
        if not self._once_written:
            values.update(self._first)
            self._once_written = True
        self._last = (step, t, data, excluded, now, self._excluded)
        return values

    def summary(self) -> dict[str, float]:
        """Whole-run figures for summary.json; the rates leave out the first log interval
        (compilation) when there is more than one."""
        out = dict(self._first)
        intervals = self._intervals[1:] or self._intervals
        steps, seconds = sum(n for n, _ in intervals), sum(t for _, t in intervals)
        if steps > 0 and seconds > 0:
            rate = steps / seconds
            out["perf/steps_per_sec"] = rate
            out["perf/examples_per_sec"] = rate * self._batch
            if self._flops and self._peak_total:
                out["perf/mfu"] = self._flops * rate * self._batch / self._peak_total
        return out

    def debug_line(self) -> str:
        """Verbosity 2: cumulative time per component and memory."""
        parts = [f"{k} {v:.2f}s" for k, v in self._totals.items()]
        if "perf/compile_sec" in self._first:
            parts.append(f"of which first step (compile) {self._first['perf/compile_sec']:.2f}s")
        return (f"jtrain: host time so far: {', '.join(parts)}; memory: {memory_summary()}")


def memory_summary() -> str:
    """Peak device memory in use (where the backend reports it) and the host's peak RSS."""
    parts = []
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001  (CPU backends may not implement memory_stats)
        stats = {}
    if "peak_bytes_in_use" in stats:
        parts.append(f"device peak {stats['peak_bytes_in_use'] / 2**30:.2f} GiB")
        if stats.get("bytes_limit"):
            parts.append(f"of {stats['bytes_limit'] / 2**30:.2f} GiB")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    parts.append(f"host peak RSS {rss / 2**20:.2f} GiB")
    return " ".join(parts)


class Profiler:
    """A jax.profiler trace of steps [start_step, start_step + num_steps) on process 0."""

    def __init__(self, profile_cfg, workdir: str, *, is_primary: bool):
        self._start = int(profile_cfg.start_step) if profile_cfg is not None else 0
        self._stop = self._start + (int(profile_cfg.num_steps) if profile_cfg is not None else 0)
        self._on = is_primary and self._start > 0
        self.directory = os.path.join(workdir, "profile")
        self._active = False

    def before_step(self, step: int) -> None:
        if self._on and step == self._start and not self._active:
            jax.profiler.start_trace(self.directory)
            self._active = True

    def after_step(self, step: int, outputs) -> bool:
        """Stops the trace after its last step; True when it did."""
        if self._active and step >= self._stop - 1:
            jax.block_until_ready(outputs)
            self.close()
            return True
        return False

    def close(self) -> None:
        if self._active:
            jax.profiler.stop_trace()
            self._active = False
