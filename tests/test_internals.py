"""jtrain.internals, the one module that reaches for private APIs of JAX, flax, qwix,
grain, optuna and torch. For each entry: a canary on the pinned versions (the private
thing exists and behaves as assumed: this fails the day a dependency moves it), and what
happens when it is gone (monkeypatched away): the fallback, or the one-line dependency
error, never an error that blames the user's config or data. Then: no other module names
a private module or one of these private names, the module stays on the ground floor,
and JAX's functions are the originals again after `jtrain.train` returns."""

from __future__ import annotations

import ast
import logging
import re
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtrain import internals
from jtrain.errors import DataError, DependencyError, render

PACKAGE = Path(internals.__file__).parent
MOVED = r"^jtrain: dependency error: {} \S+: {} moved; "


def _line(e: pytest.ExceptionInfo, dist: str, what: str) -> str:
    line = render(e.value)
    assert re.match(MOVED.format(dist, re.escape(what)), line), line
    assert e.value.exit_code == 1 and "\n" not in line
    return line


# -- JAX: the backend, the coordination service, cluster detection ------------------------


def test_backends_started_before_and_after_the_first_array():
    code = ("import jax; from jtrain import internals; a = internals.backends_started(); "
            "jax.numpy.ones(1); print(a, internals.backends_started())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin"})
    assert out.stdout.split() == ["False", "True"]


def test_backends_started_moved_is_one_line_also_for_deterministic(monkeypatch):
    from jax._src import xla_bridge

    from jtrain import precision

    jax.devices()
    assert precision.set_deterministic(True) == "deterministic: on (CPU: already deterministic)"
    monkeypatch.delattr(xla_bridge, "backends_are_initialized")
    with pytest.raises(DependencyError) as e:
        internals.backends_started()
    _line(e, "jax", "jax._src.xla_bridge.backends_are_initialized")
    with pytest.raises(DependencyError):
        precision.set_deterministic(True)
    assert precision.set_deterministic(False) is None  # off: never asks


def test_the_coordination_state_and_client_have_what_jtrain_uses():
    from jax._src import distributed
    from jax._src.lib import _jax

    state = distributed.global_state
    for name in ("client", "coordinator_address", "process_id"):
        assert hasattr(state, name), name
    for method in ("key_value_set", "blocking_key_value_get", "key_value_dir_get",
                   "key_value_delete"):
        assert hasattr(_jax.DistributedRuntimeClient, method), method
    assert internals.distributed_client() is None  # one process: nothing asked of JAX
    assert internals.coordinator_address() == ""


def test_the_coordination_state_moved(monkeypatch):
    from jax._src import distributed

    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    monkeypatch.delattr(distributed, "global_state")
    with pytest.raises(DependencyError) as e:
        internals.distributed_client()
    _line(e, "jax", "jax._src.distributed.global_state")
    assert internals.coordinator_address() == ""  # the loopback check is skipped


def test_preflight_asks_for_the_client_only_with_several_processes(monkeypatch):
    from jtrain.multihost import preflight

    def moved():
        raise AssertionError("asked")

    monkeypatch.setattr(internals, "distributed_client", moved)
    preflight.run(types.SimpleNamespace(), "abc")  # one process: returns at once
    preflight.forget()


def test_cluster_detection_reads_a_slurm_step(monkeypatch):
    for key, value in {"SLURM_JOB_ID": "4096", "SLURM_STEP_NODELIST": "node1",
                       "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}.items():
        monkeypatch.setenv(key, value)
    address, n, pid = internals.cluster_detector()(5)
    assert address.startswith("node1:") and (n, pid) == (2, 1)


def test_cluster_detection_moved_is_not_a_usage_error(monkeypatch):
    from jax._src import clusters

    from jtrain.multihost import start

    monkeypatch.delattr(clusters.ClusterEnv, "auto_detect_unset_distributed_params")
    with pytest.raises(DependencyError) as e:
        start._detect(5)
    _line(e, "jax", "jax._src.clusters.ClusterEnv.auto_detect_unset_distributed_params")


# -- JAX: compiles -----------------------------------------------------------------------


def test_the_lowering_logger_names_each_compiled_function_and_its_shapes():
    records = []
    logger = internals.lowering_logger()
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        def canary_lowered(x):
            return x * 3

        jax.jit(canary_lowered)(np.ones((2, 5), np.float32))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    hits = [r for r in records if r.msg.startswith("Compiling ") and r.args
            and "canary_lowered" in str(r.args[0])]
    assert hits and "float32[2,5]" in str(hits[0].args[1])


@pytest.fixture
def no_compile_cache():
    """As invariant._can_move: an executable moves only without the persistent cache."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    from jtrain.observe import compiles

    jax.config.update("jax_compilation_cache_dir", None)
    cc.reset_cache()
    yield
    compiles.configure_cache_for_reader("auto")  # conftest's set-up, for the next tests


def test_a_compiled_program_loads_onto_a_device(no_compile_cache):
    device = jax.devices()[0]
    x = jax.device_put(np.arange(4, dtype=np.float32), device)
    compiled = jax.jit(lambda v: jnp.sin(v) + 1).lower(x).compile()
    loaded = internals.load_compiled_on(compiled, device)
    assert isinstance(loaded, jax.stages.Compiled)
    assert np.asarray(loaded(x)).tobytes() == np.asarray(compiled(x)).tobytes()


@pytest.mark.multidevice
def test_a_program_compiled_for_one_device_runs_on_another(no_compile_cache):
    first, other = jax.devices()[:2]
    x = jax.device_put(np.arange(4, dtype=np.float32), first)
    compiled = jax.jit(lambda v: jnp.cos(v) * 3).lower(x).compile()
    moved = internals.load_compiled_on(compiled, other)
    y = jax.device_put(x, other)
    out = moved(y)
    assert out.devices() == {other}
    assert np.asarray(out).tobytes() == np.asarray(compiled(x)).tobytes()


def test_loading_moved_compiles_on_the_device_instead(monkeypatch):
    from jax.experimental import serialize_executable as se

    from jtrain import invariant

    monkeypatch.delattr(se, "_JaxPjrtUnpickler")
    device = jax.devices()[0]
    x = jax.device_put(np.arange(4, dtype=np.float32), device)
    jitted = jax.jit(lambda v: v * 2)
    with pytest.raises(AttributeError):
        internals.load_compiled_on(jitted.lower(x).compile(), device)
    again = invariant._moved(jitted.lower(x).compile(), device, jitted, (x,))
    assert np.asarray(again(x)).tolist() == [0, 2, 4, 6]


def _cache_functions():
    from jax._src import compiler, lru_cache

    return compiler._cache_write, lru_cache.LRUCache._evict_if_needed


def test_cache_patches_are_in_place_inside_and_undone_after():
    before = _cache_functions()
    with internals.compile_cache_patches() as names:
        assert names == ("write_from_every_process", "list_once_per_process")
        inside = _cache_functions()
        assert all(a is not b for a, b in zip(before, inside, strict=True))
        with internals.compile_cache_patches() as nested:  # a run inside a run
            assert nested == ()
        assert _cache_functions() == inside
    assert _cache_functions() == before


def test_a_process_other_than_0_writes_its_own_entries_during_a_run(tmp_path, monkeypatch):
    from jax._src import distributed

    from jtrain.observe import compiles

    monkeypatch.setattr(distributed.global_state, "process_id", 1)
    compiles.configure_cache(str(tmp_path / "xla"))
    try:
        def entries():
            return sorted(p.name for p in (tmp_path / "xla").iterdir())

        jax.jit(lambda v: v * 5 - 1)(np.ones(7, np.float32))  # JAX alone: process 0 writes
        assert entries() == []
        with internals.compile_cache_patches():
            jax.jit(lambda v: v * 7 - 1)(np.ones(7, np.float32))
        assert len([e for e in entries() if e.endswith("-cache")]) == 1
    finally:
        compiles.configure_cache_for_reader("auto")  # conftest's set-up, for the next tests


def test_cache_patches_moved_leave_jax_as_it_is(monkeypatch):
    from jax._src import compiler, lru_cache

    monkeypatch.delattr(compiler, "_cache_write")
    monkeypatch.setattr(lru_cache.LRUCache, "_evict_if_needed", lambda self, size: None)
    evict = lru_cache.LRUCache._evict_if_needed
    with internals.compile_cache_patches() as names:  # a changed signature: left alone
        assert names == ()
        assert lru_cache.LRUCache._evict_if_needed is evict


def test_after_train_returns_jax_s_functions_are_the_originals(tmp_path):
    import jtrain

    before = _cache_functions()
    during = []

    def on_eval(step, metrics):
        during.append(_cache_functions())

    r = np.random.default_rng(0)
    x = r.normal(size=(32, 4)).astype(np.float32)
    cfg = {"total_steps": 2, "model": {"name": "mlp", "hidden": (8,), "num_outputs": 2},
           "data": {"batch_size": 8}, "eval": {"every_steps": 2},
           "log": {"verbosity": 0, "writers": ("jsonl",)}}
    jtrain.train(cfg, str(tmp_path / "run"), train_data={"inputs": x, "targets": (
        x[:, 0] > 0).astype(np.int32)}, on_eval=on_eval)
    assert during and all(a is not b for a, b in zip(before, during[0], strict=True))
    assert _cache_functions() == before


# -- JAX: the trace ------------------------------------------------------------------------


def test_the_trace_walk_follows_a_value_to_its_input():
    internals.check_trace_walk.cache_clear()
    internals.check_trace_walk()
    seen = []

    def f(x):
        y = jnp.cos(x + 1.0)
        made = internals.trace_producer(internals.trace_primal(y))
        seen.append(made[0])
        return y

    jax.make_jaxpr(jax.grad(f))(1.0)
    assert seen == ["cos"]
    assert internals.trace_producer(np.ones(2)) is None


def test_the_trace_walk_moved_is_one_line_not_a_lora_config_error(monkeypatch):
    from jax._src.interpreters import partial_eval as pe

    from jtrain.models import lora

    monkeypatch.setattr(pe.DynamicJaxprTracer, "parent",
                        property(lambda self: None, lambda self, value: None))
    internals.check_trace_walk.cache_clear()
    lora._provider_class.cache_clear()
    try:
        with pytest.raises(DependencyError) as e:
            internals.check_trace_walk()
        _line(e, "jax", "DynamicJaxprTracer.parent (jax._src.interpreters.partial_eval)")
        pytest.importorskip("qwix")
        with pytest.raises(DependencyError):
            lora._provider_class()
    finally:
        internals.check_trace_walk.cache_clear()
        lora._provider_class.cache_clear()


def test_x_at_w_goes_through_the_intercepted_matmul(monkeypatch):
    import importlib

    paths = internals.matmul_paths()
    assert paths == ("jax.numpy.matmul", "jax._src.numpy.tensor_contractions.matmul")
    module_name, _, attr = paths[1].rpartition(".")
    module = importlib.import_module(module_name)
    assert getattr(module, attr) is jnp.matmul
    calls = []

    def spy(a, b, **kw):
        calls.append(1)
        return jnp.zeros(())

    monkeypatch.setattr(module, attr, spy)
    jnp.ones(2) @ jnp.ones(2)
    assert calls == [1]


def test_matmul_paths_moved(monkeypatch):
    monkeypatch.setattr(jnp, "matmul", lambda a, b: a)
    with pytest.raises(DependencyError) as e:
        internals.matmul_paths()
    _line(e, "jax", "jax.numpy.matmul.__wrapped__")


# -- qwix ----------------------------------------------------------------------------------


def test_qwix_helpers_are_there():
    qwix = pytest.importorskip("qwix")
    q = internals.qwix_lora()
    for name in ("parse_einsum", "layer_shapes", "params", "delta", "einsum_shapes",
                 "module", "module_path", "find_param", "unbox"):
        assert callable(getattr(q, name)), name
    a_shape, a_axes, b_shape, b_axes = q.layer_shapes((0,), (), (1,), (4,), (), (6,), 2)
    assert (a_shape, b_shape) == ((4, 2), (2, 6))
    provider = qwix.LoraProvider(module_path=".*", rank=3, alpha=1.0)
    assert internals.qwix_rank(provider) == 3
    assert callable(provider._get_current_rule_and_op_id)


def test_qwix_helpers_moved(monkeypatch):
    pytest.importorskip("qwix")
    from qwix._src.providers import lora as qlora

    monkeypatch.delattr(qlora, "_compute_lora_delta")
    internals.qwix_lora.cache_clear()
    try:
        with pytest.raises(DependencyError) as e:
            internals.qwix_lora()
        assert "_compute_lora_delta moved; LoRA (finetune.lora.rank > 0) cannot run" in \
            _line(e, "qwix", "qwix._src: _compute_lora_delta")
    finally:
        internals.qwix_lora.cache_clear()
    with pytest.raises(DependencyError):
        internals.qwix_rank(types.SimpleNamespace())


# -- grain ---------------------------------------------------------------------------------


def _grain_loader(num_epochs=1):
    import grain

    return grain.DataLoader(
        data_source=[{"x": np.float32(i)} for i in range(8)],
        sampler=grain.samplers.IndexSampler(8, grain.sharding.ShardByJaxProcess(),
                                            shuffle=False, num_epochs=num_epochs),
        shard_options=grain.sharding.ShardByJaxProcess(), worker_count=0)


def test_a_grain_loader_s_shard_and_epochs():
    loader = _grain_loader()
    assert internals.grain_loader_shard(loader) == (jax.process_index(), jax.process_count())
    assert internals.grain_loader_epochs(loader) == 1
    assert internals.grain_loader_epochs(_grain_loader(None)) is None


def test_grain_private_attributes_moved_are_no_data_error(monkeypatch):
    from jtrain.data import grain_sources

    loader = _grain_loader()
    monkeypatch.delattr(loader._sampler, "_num_epochs")
    assert internals.grain_loader_epochs(loader) == "unknown"
    monkeypatch.delattr(loader, "_shard_options")
    with pytest.raises(DependencyError) as e:
        grain_sources.check_loader_sharding(loader, "train_data", 0, 1)
    assert not isinstance(e.value, DataError)
    _line(e, "grain", "grain.DataLoader._shard_options")


# -- optuna --------------------------------------------------------------------------------


def test_an_optuna_study_s_storage_and_ids():
    optuna = pytest.importorskip("optuna")
    study = optuna.create_study(study_name="canary")
    trial = study.ask()
    storage = internals.optuna_storage(study)
    assert isinstance(storage, optuna.storages.BaseStorage)
    sid = internals.optuna_study_id(study)
    assert sid == study._study_id == storage.get_study_id_from_name("canary")
    tid = internals.optuna_trial_id(study, trial)
    assert tid == trial._trial_id == storage.get_trial_id_from_study_id_trial_number(
        sid, trial.number)
    frozen = study.get_trials(deepcopy=False)[0]
    assert internals.optuna_trial_id(study, frozen) == tid


def test_optuna_private_attributes_moved(monkeypatch):
    optuna = pytest.importorskip("optuna")
    study = optuna.create_study(study_name="canary")
    trial = study.ask()
    sid, tid = study._study_id, trial._trial_id
    monkeypatch.delattr(study, "_study_id")
    monkeypatch.delattr(trial, "_trial_id")
    assert internals.optuna_study_id(study) == sid  # asked of the storage by name
    assert internals.optuna_trial_id(study, trial) == tid  # and by number
    monkeypatch.delattr(study, "_storage")
    with pytest.raises(DependencyError) as e:
        internals.optuna_storage(study)
    _line(e, "optuna", "optuna.Study._storage")


# -- torch ---------------------------------------------------------------------------------


def test_get_worker_info_returns_the_info_set():
    torch = pytest.importorskip("torch")
    info = internals.torch_worker_info_class()(id=1, num_workers=2, seed=0, dataset=None)
    seen = internals.torch_with_worker_info(info, torch.utils.data.get_worker_info)
    assert seen is info and (seen.id, seen.num_workers) == (1, 2)
    assert torch.utils.data.get_worker_info() is None


def test_torch_worker_info_moved(monkeypatch):
    pytest.importorskip("torch")
    from torch.utils.data._utils import worker

    monkeypatch.delattr(worker, "_worker_info")
    with pytest.raises(DependencyError) as e:
        internals.torch_with_worker_info(None, lambda: None)
    _line(e, "torch", "torch.utils.data._utils.worker._worker_info")


# -- the rule: private names only here ------------------------------------------------------


def _private_names() -> set[str]:
    """The private attributes internals.py reaches for on other objects, by attribute or
    by getattr / setattr / delattr string."""
    names = set()
    for node in ast.walk(ast.parse(Path(internals.__file__).read_text())):
        if isinstance(node, ast.Attribute) and re.fullmatch(r"_[A-Za-z]\w*", node.attr) and \
                not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            names.add(node.attr)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") in (
                "getattr", "setattr", "hasattr") and len(node.args) > 1 and \
                isinstance(node.args[1], ast.Constant) and \
                re.fullmatch(r"_[A-Za-z]\w*", str(node.args[1].value)):
            names.add(node.args[1].value)
    return names - {"_jtrain_patch", "_jtrain_size"}  # jtrain's own marks


def offenders(root: Path) -> list[str]:
    names = _private_names()
    pattern = re.compile(r"\b_src\b|(?<!self)(?<!cls)\.(%s)\b|[\"'](%s)[\"']" % (
        "|".join(sorted(names)), "|".join(sorted(names))))
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "internals.py" and path.parent == root:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if pattern.search(code.replace("train_src", "").replace("eval_src", "")):
                found.append(f"{path.relative_to(root.parent)}:{n}: {line.strip()}")
    return found


def test_no_other_module_names_a_private_module_or_attribute(tmp_path):
    names = _private_names()
    assert {"_shard_options", "_storage", "_trial_id", "_cache_write", "_evict_if_needed",
            "_compute_lora_delta", "_worker_info", "_JaxPjrtUnpickler"} <= names
    assert offenders(PACKAGE) == []
    planted = tmp_path / "jtrain"
    (planted / "data").mkdir(parents=True)
    (planted / "data" / "x.py").write_text("from jax._src import distributed\n"
                                           "opts = loader._shard_options\n"
                                           "self._storage = 1\n")
    assert [line.split(":")[1] for line in offenders(planted)] == ["1", "2"]


def test_the_module_is_on_the_ground_floor():
    tree = ast.parse(Path(internals.__file__).read_text())
    ours = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("jtrain")}
    ours |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import)
             for a in node.names if a.name.startswith("jtrain")}
    assert ours == {"jtrain.errors"}
