"""Device mesh and shardings.

Owns `config.mesh`. A mesh has six axes, always in this order:
  data    - pure data parallelism (params replicated),
  fsdp    - data parallelism with params and optimizer state sharded,
  expert  - data parallelism with a mixture of experts' experts sharded (all-to-all),
  context - context parallelism: activations split along the sequence ("length"),
  tensor  - tensor (model) parallelism inside a layer,
  stage   - pipeline stages of the built-in transformer (its blocks stacked on a
            leading "stage" dimension; models/transformer.py).
The batch is split over data x fsdp x expert (each context group holds the same rows).
Model code speaks in *logical* axis names (see LOGICAL_RULES); this module is the one
place that maps them to mesh axes.
"""

from __future__ import annotations

import contextlib
import math
import sys

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jtrain.config import sections
from jtrain.config.rules import MESH_AXES, resolve_axis_sizes
from jtrain.errors import ConfigError

BATCH_AXES = ("data", "fsdp", "expert")

# Logical axis name -> mesh axis (or None = replicated). Built-in models annotate
# parameters only with these names.
LOGICAL_RULES = (
    ("batch", BATCH_AXES),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    # MoE experts split over fsdp x expert: with mesh.expert > 1 each device runs its
    # share of the experts and tokens reach them by all-to-all over `expert`
    # (models/moe.py); "mlp" inside each expert stays on tensor
    # (docs/guide/scaling-out.md).
    ("expert", ("fsdp", "expert")),
    ("kv", None),
    ("length", "context"),
    ("layers", None),
    ("stage", "stage"),
    ("classes", None),
    ("norm", None),
)


@contextlib.contextmanager
def model_context(mesh: Mesh | None = None):
    """Where jtrain builds, traces and runs a model: `jax.set_mesh(mesh)` (when given) and
    LOGICAL_RULES as flax's logical-axis rules, so Linen `nn.with_logical_partitioning`
    / `nn.with_logical_constraint` and NNX `nnx.with_partitioning` (flax.core.spmd's one
    rules context serves both) resolve logical names to this mesh's axes."""
    with contextlib.ExitStack() as stack:
        if mesh is not None:
            stack.enter_context(jax.set_mesh(mesh))
        stack.enter_context(nn.logical_axis_rules(LOGICAL_RULES))
        yield


def unknown_axes(annotated_tree, mesh: Mesh, rules=LOGICAL_RULES) -> list[str]:
    """"<param path> [shape]: ..." for every annotated dimension whose name is neither a
    mesh axis nor a logical name of `rules` (a typo that would otherwise replicate it)."""
    table = dict(rules)
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(annotated_tree,
                                                             is_leaf=_is_annotated)[0]:
        shape = getattr(_unboxed(leaf), "shape", ())
        for i, name in enumerate(_spec_of(leaf)[:len(shape)]):
            if name is not None and name not in mesh.shape and name not in table:
                out.append(f"{_path_str(path)} {list(shape)}: unknown logical axis {name!r} "
                           f"(dim {i}); use one of {', '.join(k for k, _ in rules)} "
                           f"(jtrain.mesh.LOGICAL_RULES) or a mesh axis "
                           f"({', '.join(MESH_AXES)})")
    return out


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def make_mesh(mesh_cfg=None, devices=None) -> Mesh:
    """A Mesh over `devices` (default: all) with Auto axis types. `mesh_cfg`: the `mesh`
    section, whole or partial (`{"fsdp": 2}`; None: the defaults, all devices on `data`).

    Auto, not jax.make_mesh's default Explicit: FSDP-style parameter sharding with
    sharding constraints fails under Explicit axes (see PITFALLS).

    Examples:
        ```python
        import jtrain

        mesh = jtrain.make_mesh()                  # every device on the data axis
        mesh = jtrain.make_mesh({"fsdp": 2})       # data x 2-way fsdp (8 devices: 4 x 2)
        print(dict(mesh.shape))
        ```
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_axis_sizes(sections.section("mesh", mesh_cfg), len(devices))
    try:
        # Topology-aware device order where the platform knows one (GPU/TPU); `import jax`
        # alone does not load this submodule.
        from jax.experimental import mesh_utils

        dev_array = mesh_utils.create_device_mesh(shape, devices=devices)
    except Exception:  # CPU fakes and odd counts: plain order is the right answer.
        dev_array = np.asarray(devices).reshape(shape)
    return Mesh(dev_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension split over data x fsdp; everything else replicated.

    Examples:
        ```python
        mesh = jtrain.make_mesh()
        x = jax.device_put(batch["inputs"], jtrain.batch_sharding(mesh))
        ```
    """
    return NamedSharding(mesh, P(BATCH_AXES))


def data_parallel_size(mesh: Mesh) -> int:
    """How many ways the batch is split (data x fsdp x expert)."""
    return int(np.prod([mesh.shape[a] for a in BATCH_AXES]))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def loaded_nnx():
    """flax.nnx when something has imported it, else None: no NNX object can exist then,
    so type checks need not import it (a Linen run does not pay for NNX's import)."""
    return sys.modules.get("flax.nnx")


def _is_nnx_variable(x) -> bool:
    nnx = loaded_nnx()
    return nnx is not None and isinstance(x, nnx.Variable)


def _spec_of(leaf):
    """The partition names of one annotated leaf (Linen box or NNX variable), or ()."""
    if isinstance(leaf, nn.LogicallyPartitioned):
        return tuple(leaf.names)
    if isinstance(leaf, nn.Partitioned):
        return tuple(leaf.names)
    if _is_nnx_variable(leaf):
        names = leaf.get_metadata().get("out_sharding") or leaf.get_metadata().get("sharding_names")
        return tuple(names) if names else ()
    return ()


def _is_annotated(x) -> bool:
    return isinstance(x, nn.Partitioned) or _is_nnx_variable(x)


def _unboxed(x):
    """The value inside a Linen Partitioned box or an NNX Variable (`get_value()`:
    flax deprecates `Variable.value`); anything else as it is."""
    if _is_nnx_variable(x):
        return x.get_value()
    return x.value if isinstance(x, nn.Partitioned) else x


def auto_shard_bytes(mesh_cfg=None) -> int | None:
    """`mesh.auto_shard_min_bytes` when `mesh.auto_shard` is on, else None (off)."""
    m = sections.section("mesh", mesh_cfg)
    return int(m["auto_shard_min_bytes"]) if m["auto_shard"] else None


def auto_dims(shape, dtype, mesh: Mesh, min_bytes: int | None) -> tuple:
    """mesh.auto_shard's rule for a leaf the model did not annotate: its largest dimension
    divisible by the fsdp size goes on the fsdp axis (ties: the first), PyTorch FSDP's
    per-parameter sharding with the dimension picked to fit; () (replicated) when auto
    sharding is off, the fsdp axis has size 1, the leaf is under `min_bytes` or no
    dimension divides."""
    n = mesh.shape.get("fsdp", 1)
    if min_bytes is None or n <= 1 or not shape:
        return ()
    if math.prod(shape) * np.dtype(dtype).itemsize < min_bytes:
        return ()
    best = None
    for i, d in enumerate(shape):
        if d % n == 0 and (best is None or d > shape[best]):
            best = i
    return () if best is None else tuple("fsdp" if i == best else None
                                         for i in range(len(shape)))


def logical_to_shardings(abstract_tree, mesh: Mesh, rules=LOGICAL_RULES, *,
                         auto_shard_min_bytes: int | None = None):
    """NamedShardings for a tree of parameters, from their annotations.

    Understands Linen `nn.with_logical_partitioning` boxes and NNX `nnx.with_partitioning`
    metadata. Names are logical (mapped with `rules`) or mesh axis names (kept). Leaves
    without annotations are replicated, or with `auto_shard_min_bytes` (mesh.auto_shard's
    threshold; None = off) placed by `auto_dims`. A dimension whose size does not divide its mesh
    axes is replicated, so an odd-sized param never makes a mesh unusable. The result
    has the structure of the *unboxed* tree (plain arrays where the boxes were). A name
    that is neither is a ConfigError("model", ...) naming the parameter.

    An annotated leaf's spec has one entry per dimension (`P(None, None)` when it is
    replicated); an unannotated one's has `auto_dims`' entries, `P()` when replicated:
    `layout` tells the two apart by that.
    """
    unknown = unknown_axes(abstract_tree, mesh, rules)
    if unknown:
        raise ConfigError("model", unknown[0])
    table = dict(rules)

    def to_mesh_axis(name):  # a logical name first: "expert" is both
        return table[name] if name in table else name

    def fit(leaf):
        names = _spec_of(leaf)
        value = _unboxed(leaf)
        shape = getattr(value, "shape", ())
        if not names and shape:  # not annotated: mesh.auto_shard's rule
            return NamedSharding(mesh, P(*auto_dims(shape, value.dtype, mesh,
                                                    auto_shard_min_bytes)))
        dims, used = [], set()
        for i in range(len(shape)):
            axis = to_mesh_axis(names[i]) if i < len(names) else None
            axes = () if axis is None else (axis if isinstance(axis, tuple) else (axis,))
            size = math.prod(mesh.shape[a] for a in axes)
            if not axes or shape[i] % size or used & set(axes):
                dims.append(None)
            else:  # size-1 axes of a tuple left out: ("fsdp", "expert") is "fsdp" at expert=1
                used |= set(axes)
                kept = tuple(a for a in axes if mesh.shape[a] > 1) or axes[:1]
                dims.append(kept[0] if len(kept) == 1 else kept)
        return NamedSharding(mesh, P(*dims))

    shardings = jax.tree.map(fit, abstract_tree, is_leaf=_is_annotated)
    return shardings


def gpipe(microbatches: int, stages: int) -> list[tuple[int, ...]]:
    """The GPipe schedule the pipeline runs: one row per iteration (microbatches + stages
    - 1 of them), the microbatch each stage works on then, -1 where it idles."""
    return [tuple(it - k if 0 <= it - k < microbatches else -1 for k in range(stages))
            for it in range(microbatches + stages - 1)]


def bubble(microbatches: int, stages: int) -> float:
    """The share of stage-iterations the schedule leaves idle: (S - 1) / (M + S - 1)."""
    rows = gpipe(microbatches, stages)
    return sum(j < 0 for row in rows for j in row) / (len(rows) * stages)


def pipeline_line(stages: int, microbatches: int, layers: int) -> str:
    """The header's line for mesh.stage > 1, the bubble counted from `gpipe`."""
    return (f"jtrain: pipeline: {layers} blocks in {stages} stages over mesh.stage, "
            f"{microbatches} microbatches per pass (GPipe), bubble "
            f"{bubble(microbatches, stages):.1%} of each pass ((S-1)/(M+S-1))")


# Mesh axes that shard parameters; `data` never does (pure data parallelism).
PARAM_AXES = ("fsdp", "expert", "tensor", "stage")


def layout(abstract_tree, shardings, min_bytes: int | None = None) -> dict:
    """How a tree of arrays lies on the devices: {"total_bytes", "per_device_bytes" (the
    largest shard set one device holds), "sharded", "annotated", "replicated", "small"}
    with leaf counts ("sharded": split on some device axis of size > 1) and of the
    replicated ones apart: "annotated" the model annotated (a spec with an entry per
    dimension: `logical_to_shardings`) and that lies whole on each device,
    "small" the other replicated leaves under `min_bytes` (mesh.auto_shard's threshold;
    None = no threshold), "replicated" the rest."""
    out = {"total_bytes": 0, "per_device_bytes": 0, "sharded": 0, "annotated": 0,
           "replicated": 0, "small": 0}
    for leaf, sharding in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(shardings),
                              strict=True):
        shape, itemsize = tuple(leaf.shape), np.dtype(leaf.dtype).itemsize
        nbytes = math.prod(shape) * itemsize
        out["total_bytes"] += nbytes
        shard = tuple(sharding.shard_shape(shape))
        out["per_device_bytes"] += math.prod(shard) * itemsize
        if shard != shape:  # split (an axis of size 1 in its spec splits nothing)
            out["sharded"] += 1
        elif shape and len(sharding.spec) == len(shape):
            out["annotated"] += 1
        elif min_bytes is not None and nbytes < min_bytes:
            out["small"] += 1
        else:
            out["replicated"] += 1
    return out


def idle_axes(shardings, mesh: Mesh) -> list[str]:
    """The parameter axes (fsdp, expert, tensor, stage) of size > 1 that no leaf of
    `shardings` is split over: their devices hold copies (a warning, never silent)."""
    used = set()
    for sharding in jax.tree.leaves(shardings):
        for entry in sharding.spec:
            used |= set(entry) if isinstance(entry, tuple) else {entry}
    return [a for a in PARAM_AXES if mesh.shape.get(a, 1) > 1 and a not in used]


def sharding_conflicts(annotated_tree, mesh: Mesh, rules=LOGICAL_RULES
                       ) -> list[tuple[str, str]]:
    """Where `logical_to_shardings` falls back to replicating a dimension the model
    asked to shard: ("mesh.<axis>", "<param path> [shape]: <why>"), one per dimension
    (for the dry run)."""
    table = dict(rules)
    out = []
    leaves = jax.tree_util.tree_flatten_with_path(annotated_tree, is_leaf=_is_annotated)[0]
    for path, leaf in leaves:
        names = _spec_of(leaf)
        shape = getattr(_unboxed(leaf), "shape", ())
        where = _path_str(path)
        used: dict[str, str] = {}
        for i, name in enumerate(names[:len(shape)]):
            if name is None:
                continue
            if name not in mesh.shape and name not in table:
                out.append(("mesh", f"{where} {list(shape)}: no logical rule for axis {name!r} "
                           f"(dim {i}; rules: {', '.join(k for k, _ in rules)})"))
                continue
            axis = table[name] if name in table else name
            axes = () if axis is None else (axis if isinstance(axis, tuple) else (axis,))
            size = math.prod(mesh.shape[a] for a in axes)
            clash = [a for a in axes if a in used]
            if clash:
                out.append((f"mesh.{clash[0]}", f"{where} {list(shape)}: {name!r} (dim {i}) "
                            f"and {used[clash[0]]!r} both map to mesh axis {clash[0]}"))
            elif axes and shape[i] % size:
                out.append((f"mesh.{axes[0]}", f"{where} {list(shape)}: dim {i} ({shape[i]}, "
                            f"{name!r}) is not divisible by "
                            f"{'x'.join(f'{a}={mesh.shape[a]}' for a in axes)}"))
            else:  # applied, as logical_to_shardings does
                used.update({a: name for a in axes})
    return out


def process_values(value: int) -> list[int]:
    """`value` from every process, in process order (one small all-gather; no
    communication on one process). The data layer is handed this instead of calling
    collectives itself."""
    if jax.process_count() == 1:
        return [int(value)]
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(np.asarray([value], np.int64))
    return [int(v) for v in np.asarray(gathered).reshape(-1)]


def host_to_device(batch, mesh: Mesh):
    """THE host->device transfer: per-process numpy batch -> global arrays sharded on
    the batch axis. Every process passes its own rows, in process order.

    Examples:
        ```python
        mesh = jtrain.make_mesh()
        batch = {"inputs": np.zeros((8, 4), np.float32), "targets": np.zeros(8, np.int32)}
        on_devices = jtrain.host_to_device(batch, mesh)   # sharded on the batch axis
        ```
    """
    sharding = batch_sharding(mesh)
    if jax.process_count() == 1:  # the local batch is the global batch; ~2x cheaper
        return jax.device_put(batch, sharding)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), batch)
