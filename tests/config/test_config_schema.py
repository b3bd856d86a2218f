"""The config has one home: every key declared once in jtrain.config.schema, with a doc
and a resume rule; no defaults or choice lists anywhere else."""

from __future__ import annotations

import ast
from pathlib import Path

from jtrain import config as config_lib
from jtrain import models, optim
from jtrain.config import schema
from jtrain.metrics import tasks
from jtrain.models import mlp
from jtrain.observe import writers

PACKAGE = Path(__file__).resolve().parents[2] / "jtrain"


def test_every_key_has_a_doc_and_a_resume_rule():
    keys = config_lib.describe()
    assert len(keys) > 80
    for key, field in keys:
        assert isinstance(field, schema.Field), key
        assert field.doc.strip() and "\n" not in field.doc, key
        assert isinstance(field.resume, bool), key


def test_resume_rule_is_the_one_that_was_measured():
    """The keys that may differ on resume: they cannot change the trained state."""
    safe_prefixes = ("log.", "eval.", "checkpoint.", "init.", "profile.", "perf.", "mesh.",
                     "compile.", "early_stop.", "nonfinite.", "watchdog.", "memory.",
                     "tune.",  # read by python -m jtrain.tune only, never by a run
                     "distributed.",  # timeouts and checks between processes
                     "debug.",  # what is recorded (hashes.jsonl), never the state
                     "sample.")  # read after the last step (tests/engine/test_train_e2e.py)
    # (plateau.* changes the learning rate from then on; determinism.gpu_ops and memory.*
    # change only the float reduction order, like mesh.*)
    safe_keys = {"max_steps_in_flight", "data.num_workers", "data.num_threads",
                 "data.prefetch", "data.device_prefetch", "determinism.gpu_ops",
                 "loss.eval_scope"}
    # eval.mode / eval.async_lag move the step at which plateau, early stopping and
    # best-k decide (the learning rate from then on), like plateau.*
    # mesh.stage lays the parameters out otherwise (blocks stacked per stage)
    unsafe_keys = {"eval.mode", "eval.async_lag", "mesh.stage"}
    for key, _ in config_lib.describe():
        dotted = key.split(" ")[0]
        expected = (dotted.startswith(safe_prefixes) or dotted in safe_keys) \
            and dotted not in unsafe_keys
        assert config_lib.resume_safe(dotted) is expected, dotted
    assert not config_lib.resume_safe("model.d_model")
    assert not config_lib.resume_safe("no.such.key")


def test_consumers_choices_agree_with_the_schema():
    assert set(optim._SCHEDULES) == set(schema.SCHEDULES)
    assert set(models.MODELS) == set(schema.MODEL_FAMILIES)
    assert set(mlp.ACTIVATIONS) == set(schema.ACTIVATIONS)
    assert tasks.METRIC_NAMES == schema.METRIC_NAMES
    assert set().union(*tasks._ALLOWED.values()) == set(schema.METRIC_NAMES)
    assert writers.config_lib.WRITERS == schema.WRITERS


def test_no_defaults_outside_the_schema():
    """No module but the schema defines a module-level table of defaults."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "config" / "schema.py":
            continue
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AnnAssign) else [])
            for t in targets:
                if isinstance(t, ast.Name) and t.id.upper().endswith(("DEFAULTS", "DEFAULT")):
                    offenders.append(f"{path.relative_to(PACKAGE)}: {t.id}")
    assert offenders == []


def test_config_imports_nothing_that_imports_it_back():
    for path in (PACKAGE / "config").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jtrain"):
                assert node.module.startswith(("jtrain.config", "jtrain.errors",
                                               "jtrain.redact")), (path.name, node.module)


def test_resolve_never_mutates_and_partial_model_sections_resolve():
    user = {"optim": {"lr": 0.5}}
    cfg = config_lib.resolve(user)
    assert user == {"optim": {"lr": 0.5}} and cfg.optim.lr == 0.5
    m = config_lib.resolve_model({"name": "mlp", "num_outputs": 3})
    assert m.num_outputs == 3 and tuple(m.hidden) == (64, 64)
