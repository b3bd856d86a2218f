"""The eval loop: padded batches with a validity mask, one compile, exact sums.

Per-batch sums come back from the device a few batches behind (bounded in flight, see
`MAX_IN_FLIGHT`) and are added on the host in float64, so the result does not depend on
how the examples were split into batches, devices or processes.
"""

from __future__ import annotations

import math
from collections import deque

import jax
import numpy as np

from jtrain import data as data_lib
from jtrain import mesh as mesh_lib

MAX_IN_FLIGHT = 8


def run_eval(eval_step, params, source, *, mesh, local_batch: int, max_batches: int = 0,
             bytes_per_token: bool = False) -> dict[str, float]:
    """Metrics over every example of `source` (or the first `max_batches` batches)."""
    totals: dict[str, float] = {}
    pending: deque = deque()

    def drain(out):
        for k, v in jax.device_get(out).items():
            totals[k] = totals.get(k, 0.0) + float(np.float64(v))

    batches = data_lib.eval_batches(
        source, local_batch=local_batch, process_index=jax.process_index(),
        process_count=jax.process_count(), max_batches=max_batches)
    for batch in batches:
        pending.append(eval_step(params, mesh_lib.host_to_device(batch, mesh)))
        if len(pending) > MAX_IN_FLIGHT:
            drain(pending.popleft())
    while pending:
        drain(pending.popleft())
    return summarize(totals, bytes_per_token=bytes_per_token)


def summarize(totals: dict[str, float], *, bytes_per_token: bool = False) -> dict[str, float]:
    weight = totals.get("weight", 0.0)
    if weight <= 0:
        return {}
    loss = totals["loss_sum"] / weight
    out = {"eval/loss": loss, "eval/examples_weight": weight}
    if totals.get("counted"):
        out["eval/accuracy"] = totals["correct"] / totals["counted"]
    if bytes_per_token:
        out["eval/perplexity"] = math.exp(min(loss, 700.0))
        out["eval/bits_per_byte"] = loss / math.log(2)
    return out
