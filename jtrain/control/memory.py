"""Memory planning: the gradient-accumulation count whose train step fits the budget.

Before the first step, when a per-device budget is known (`memory.budget_bytes` > 0, or
-1 for the device's own limit), the train step is compiled ahead of time and XLA's
`compiled.memory_analysis()` says what one step needs on a device: arguments + outputs
- donated aliases + temporaries + generated code. If that exceeds the budget, the planner
tries larger `optim.grad_accum_steps` (each a divisor of the per-device batch, so every
microbatch is whole): the step scans over smaller microbatches and sums their
token-weighted losses and gradients, so the update, and the training result, is the same
as with the configured count up to float rounding (jtrain.step). The smallest count that
fits wins; none fitting (microbatch 1 per device) is a config error before any step.

Each count tried costs one compile at start-up, which is why planning is opt-in.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from jtrain.errors import ConfigError

DEVICE_LIMIT = -1.0  # memory.budget_bytes: the device's own limit (bytes_limit)


def device_budget(budget_bytes: float, device) -> tuple[int | None, str]:
    """(budget in bytes or None = no planning, where it comes from)."""
    if budget_bytes > 0:
        return int(budget_bytes), "memory.budget_bytes"
    if budget_bytes == DEVICE_LIMIT:
        stats = device.memory_stats() or {}  # None on CPU
        limit = stats.get("bytes_limit")
        if limit:
            return int(limit), f"the {device.platform} device's limit"
    return None, ""


def step_bytes(compiled) -> int:
    """Per-device bytes one call of a compiled step holds at its peak (XLA's estimate)."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
               + m.temp_size_in_bytes + m.generated_code_size_in_bytes)


@dataclasses.dataclass(frozen=True)
class Plan:
    accum: int  # grad_accum_steps to use
    configured: int  # grad_accum_steps in the config
    per_device_batch: int
    budget: int
    source: str  # where the budget came from
    tried: tuple[tuple[int, int], ...]  # (grad_accum_steps, bytes) in the order compiled

    @property
    def bytes(self) -> int:
        return dict(self.tried)[self.accum]

    def describe(self) -> str:
        need = _size(self.bytes)
        if self.accum == self.configured:
            return (f"memory: the train step needs {need} per device of {_size(self.budget)} "
                    f"({self.source}); grad_accum_steps={self.accum} kept")
        return (f"memory: grad_accum_steps={self.configured} needs "
                f"{_size(dict(self.tried)[self.configured])} per device, over "
                f"{_size(self.budget)} ({self.source}); planned grad_accum_steps="
                f"{self.accum} (microbatch {self.per_device_batch // self.accum} per "
                f"device): {need}; same global batch, same updates")


def plan(measure: Callable[[int], int], *, per_device_batch: int, configured: int,
         budget: int, source: str) -> Plan:
    """The smallest grad_accum_steps >= `configured` (a multiple of it dividing
    `per_device_batch`) whose step fits `budget`. `measure(k)` compiles the step with k
    and returns its bytes. Memory falls as k grows, so the candidates are bisected:
    about log2(candidates) compiles."""
    candidates = [k for k in range(configured, per_device_batch + 1)
                  if per_device_batch % k == 0 and k % configured == 0]
    tried: dict[int, int] = {}

    def fits(k):
        if k not in tried:
            tried[k] = measure(k)
        return tried[k] <= budget

    if fits(configured):
        return Plan(configured, configured, per_device_batch, budget, source,
                    tuple(tried.items()))
    lo, hi = 1, len(candidates) - 1  # candidates[0] does not fit
    if not fits(candidates[hi]):
        raise ConfigError(
            "memory.budget_bytes",
            f"the train step needs {_size(tried[candidates[hi]])} per device even at "
            f"microbatch {per_device_batch // candidates[hi]} (grad_accum_steps="
            f"{candidates[hi]}), over {_size(budget)} ({source}); use more devices "
            "(mesh.fsdp shards the params and optimizer state, mesh.context the built-in "
            "transformer's sequences), a smaller model or a "
            "smaller data.batch_size")
    while lo < hi:  # invariant: candidates[hi] fits
        mid = (lo + hi) // 2
        if fits(candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    return Plan(candidates[hi], configured, per_device_batch, budget, source,
                tuple(tried.items()))


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"
