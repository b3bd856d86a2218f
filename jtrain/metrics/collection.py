"""Named collections of metrics, and their exact reduction across processes."""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from flax import struct
from jax.experimental import multihost_utils

from jtrain.metrics.base import to_host
from jtrain.metrics.classification import ConfusionMatrix
from jtrain.metrics.gathered import check_capacity


@struct.dataclass
class MetricCollection:
    """Named metrics updated with the same batch; compute() flattens to one dict of floats.

    A metric computing a float is reported under its name; one computing a dict contributes
    its own keys (e.g. f1_macro). A ConfusionMatrix computes a matrix: compute() leaves it
    out and compute_arrays() returns it under its name.

    Attributes:
        metrics: `{name: metric state}`.

    Examples:
        ```python
        import jax.numpy as jnp
        from jtrain import metrics

        logits = jnp.array([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0], [1.0, 2.0, 0.0]])
        labels = jnp.array([0, 1, 1, 0])
        c = metrics.MetricCollection.empty({"accuracy": metrics.Accuracy.empty(),
                                           "loss": metrics.Loss.empty()})
        c = c.update(logits=logits, labels=labels, loss=jnp.array([0.1, 0.2, 0.3, 0.4]))
        c.compute()                                    # {'accuracy': 0.5, 'loss': 0.25}
        ```
    """
    metrics: dict[str, Any]

    @classmethod
    def empty(cls, metrics: dict[str, Any]):
        for name, metric in metrics.items():
            if not all(hasattr(metric, m) for m in ("update", "merge", "compute", "JITTABLE")):
                raise TypeError(f"MetricCollection[{name!r}]: {metric!r} is not a metric")
        return cls(metrics=dict(metrics))

    @property
    def JITTABLE(self) -> bool:  # noqa: N802  (same spelling as the metrics' class attribute)
        return all(m.JITTABLE for m in self.metrics.values())

    def partition(self) -> tuple[MetricCollection, MetricCollection]:
        """(jittable metrics, host-side metrics), to update on device and on host."""
        return (self.replace(metrics={k: m for k, m in self.metrics.items() if m.JITTABLE}),
                self.replace(metrics={k: m for k, m in self.metrics.items() if not m.JITTABLE}))

    def update(self, **batch):
        return self.replace(metrics={k: m.update(**batch) for k, m in self.metrics.items()})

    def merge(self, other):
        if not isinstance(other, MetricCollection) or other.metrics.keys() != self.metrics.keys():
            raise ValueError("cannot merge metric collections with different metric names")
        return self.replace(metrics={k: m.merge(other.metrics[k]) for k, m in self.metrics.items()})

    def compute(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, metric in self.metrics.items():
            if isinstance(metric, ConfusionMatrix):
                continue
            value = metric.compute()
            items = value.items() if isinstance(value, dict) else [(name, value)]
            for key, v in items:
                if key in out:
                    raise ValueError(f"MetricCollection: two metrics produce the key {key!r}")
                out[key] = float(v)
        return out

    def compute_arrays(self) -> dict[str, np.ndarray]:
        """The matrix-valued metrics (confusion matrices), by name."""
        return {name: m.compute() for name, m in self.metrics.items()
                if isinstance(m, ConfusionMatrix)}


def _allgather_exact(tree):
    """process_allgather (stacked: leaves get a leading [P] axis) keeping float64 / int64.

    Without jax_enable_x64 JAX would cast 64-bit values to 32 bits, so each leaf travels as
    its raw bytes in uint32 words.
    """
    leaves, treedef = jax.tree.flatten(tree)
    host = [to_host(x) for x in leaves]
    # (np.ascontiguousarray would turn 0-d leaves into 1-d ones: flatten first.)
    words = [np.ascontiguousarray(x.reshape(-1)).view(np.uint32) for x in host]
    gathered = multihost_utils.process_allgather(words)
    out = [np.ascontiguousarray(np.asarray(g, np.uint32)).view(x.dtype).reshape((-1,) + x.shape)
           for g, x in zip(gathered, host, strict=True)]
    return jax.tree.unflatten(treedef, out)


def _gather_buffers(metric):
    """Concatenates every process's buffers, in process order (lengths may differ)."""
    buffers = metric.buffers()                  # name -> [n, ...], masked entries already gone
    n = len(next(iter(buffers.values())))
    lengths = _allgather_exact(np.array(n, np.int64)).reshape(-1)   # [P]
    width = max(int(lengths.max()), 1)
    padded = {k: np.concatenate([v, np.zeros((width - n,) + v.shape[1:], v.dtype)])
              for k, v in buffers.items()}
    gathered = _allgather_exact(padded)         # name -> [P, width, ...]
    merged = metric.replace(**{
        k: (np.concatenate([g[p, :lengths[p]] for p in range(len(lengths))]),)
        for k, g in gathered.items()})
    check_capacity(merged)
    return merged


def reduce_across_processes(metric):
    """The metric over all ``jax.process_count()`` processes (identity for one process).

    Sum-style states are gathered and merged (Chan's formula where it applies), in float64.
    Host-side metrics (AUROC, Spearman) concatenate their buffers, whose lengths may differ
    per process. Every process must call this with the same metric structure (a collective).
    A state whose leaves are global arrays spanning processes came out of a jitted step over
    a global batch: it already covers every process and is only fetched, not summed again.

    Examples:
        ```python
        import jax.numpy as jnp
        from jtrain import metrics

        total = metrics.reduce_across_processes(local)   # local: this process's merged state
        print(total.compute())                          # the same on every process
        ```
    """
    if jax.process_count() == 1:
        return metric
    if isinstance(metric, MetricCollection):
        return metric.replace(metrics={k: reduce_across_processes(m)
                                       for k, m in sorted(metric.metrics.items())})
    if any(isinstance(x, jax.Array) and not x.is_fully_addressable
           for x in jax.tree.leaves(metric)):
        return jax.tree.map(to_host, metric)
    if not metric.JITTABLE:
        return _gather_buffers(metric)
    stacked = _allgather_exact(metric)
    parts = [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(jax.process_count())]
    return functools.reduce(lambda a, b: a.merge(b), parts)
