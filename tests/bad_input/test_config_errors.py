"""Every bad config: one stderr line `jtrain: config error: <key or file>: <why>`, exit 2.

Most cases run in-process through `jtrain.main.cli` (fast); a few run the real
`python -m jtrain.main` entrypoint. A bad config must never reach training: the
workdir stays empty (no checkpoints), and the training loop is never entered.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jtrain import config as config_lib
from jtrain import main as main_lib
from jtrain.engine import loop as loop_lib

REPO = Path(__file__).resolve().parents[2]
DEBUG = "--config=configs/base.py:debug"
PREFIX = "jtrain: config error: "

# Config files for the file-level cases; "{cfg}" in a case is this folder.
CONFIG_FILES = {
    "syntax.py": "def get_config(:\n",
    "noget.py": "X = 1\n",
    "none.py": "def get_config():\n    return None\n",
    "raises.py": "def get_config():\n    raise RuntimeError('boom')\n",
    "nan_lr.py": ("import ml_collections\n\ndef get_config():\n"
                  "    return ml_collections.ConfigDict({'optim': {'lr': float('nan')}})\n"),
    "typo_section.py": ("import ml_collections\n\ndef get_config():\n"
                        "    return ml_collections.ConfigDict({'optimizer': {'lr': 0.1}})\n"),
}

# (argv after the program name, expected key or file, a substring of the reason: every case says
# why). The workdir is appended by the test; a later --workdir= overrides it.
CASES = [
    # The config file itself.
    (["--config={cfg}/nope.py"], "{cfg}/nope.py", "no such file"),
    (["--config={cfg}"], "{cfg}", "cannot read"),  # a directory
    (["--config="], "--config", "cannot read: Path to config file is an empty string"),
    (["--config={cfg}/syntax.py"], "{cfg}/syntax.py", "syntax error at line 1"),
    (["--config={cfg}/noget.py"], "{cfg}/noget.py", "get_config()"),
    (["--config={cfg}/none.py"], "{cfg}/none.py", "returned NoneType"),
    (["--config={cfg}/raises.py"], "{cfg}/raises.py", "boom"),
    (["--config=configs/base.py:bogus"], "configs/base.py", "'bogus'"),
    (["--config={cfg}/nan_lr.py"], "optim.lr", "finite"),
    (["--config={cfg}/typo_section.py"], "optimizer", 'did you mean "optim"'),
    # Override keys.
    ([DEBUG, "--config.optimzer.lr=1"], "optimzer.lr", 'did you mean "optim"'),
    ([DEBUG, "--config.optim.lrr=1"], "optim.lrr", 'did you mean "lr"'),
    ([DEBUG, "--config.bogus=1"], "bogus", "unknown key"),
    # Old key names: the new one, in one line.
    ([DEBUG, "--config.optim.muon_beta=0.9"], "optim.muon_beta",
     "renamed to optim.kwargs.beta (with optim.name='muon')"),
    ([DEBUG, "--config.checkpoint.init_from=runs/a"], "checkpoint.init_from",
     "renamed to init.path"),
    ([DEBUG, "--config.deterministic=true"], "deterministic", "renamed to determinism.gpu_ops"),
    ([DEBUG, "--config.eval.async_nice=0"], "eval.async_nice",
     "no longer a config key; set the environment variable JTRAIN_EVAL_NICE"),
    ([DEBUG, "--config.model.factory=mymod:make"], "model.factory",
     "a key of model.name='user' only, not of this config's model; set model.name"),
    ([DEBUG, "--config.optim.lr.x=1"], "optim.lr.x", "not a section"),
    (["--config.optim.lr=1", DEBUG], "optim.lr", "before --config"),
    ([DEBUG, "--config.optim.lr=1", "--config.optim=3"], "optim", "overwrite"),
    # Types.
    ([DEBUG, "--config.total_steps=1.5"], "total_steps", "must be an integer"),
    ([DEBUG, "--config.optim.lr=abc"], "optim.lr", "must be a number"),
    ([DEBUG, "--config.optim.lr="], "optim.lr", "must be a number, got ''"),
    ([DEBUG, "--config.data.shuffle=maybe"], "data.shuffle", "true or false"),
    ([DEBUG, "--config.optim=3"], "optim", "`3` is not a dict"),
    ([DEBUG, "--config.log.writers=(1,2)"], "log.writers", "must be str"),
    # Non-finite and out-of-range numbers.
    ([DEBUG, "--config.optim.lr=nan"], "optim.lr", "finite"),
    ([DEBUG, "--config.optim.lr=1e400"], "optim.lr", "finite"),
    ([DEBUG, "--config.optim.lr=-inf"], "optim.lr", "finite"),
    ([DEBUG, "--config.optim.lr=-0.1"], "optim.lr", ">= 0"),
    ([DEBUG, "--config.total_steps=0"], "total_steps", ">= 1"),
    ([DEBUG, "--config.total_steps=99999999999999999999999"], "total_steps", "<="),
    ([DEBUG, "--config.data.batch_size=-4"], "data.batch_size", ">= 1"),
    ([DEBUG, "--config.seed=-1"], "seed", ">= 0"),
    ([DEBUG, "--config.optim.b1=1.5"], "optim.b1", "<= 1"),
    ([DEBUG, "--config.log.every_steps=0"], "log.every_steps", ">= 1"),
    ([DEBUG, "--config.checkpoint.max_to_keep=0"], "checkpoint.max_to_keep", ">= 1"),
    # Names.
    ([DEBUG, "--config.optim.name=adamx"], "optim.name", 'did you mean "adam"'),
    ([DEBUG, "--config.optim.schedule=cosin"], "optim.schedule", 'did you mean "cosine"'),
    ([DEBUG, "--config.model.name=cnn"], "model.name", "'cnn'"),
    ([DEBUG, "--config.model.dtype=fp8"], "model.dtype", "'fp8'"),
    ([DEBUG, "--config.log.writers=('jsonl','csv')"], "log.writers", "'csv'"),
    ([DEBUG, "--config.log.wandb_mode=on"], "log.wandb_mode", "'on'"),
    # Rules across keys, and the model family's own checks.
    ([DEBUG, "--config.optim.grad_accum_steps=3"], "optim.grad_accum_steps", "divisible"),
    ([DEBUG, "--config.data.seq_len=65"], "data.seq_len", "max_len=64"),
    # (a warmup as long as the run is shortened, with a notice: tests/test_console_run.py)
    ([DEBUG, "--config.optim.decay_steps=5"], "optim.decay_steps", "> optim.warmup_steps"),
    ([DEBUG, "--config.optim.name=adam"], "optim.weight_decay", "adamw"),
    ([DEBUG, "--config.model.num_heads=3"], "model.num_heads", "divisible"),
    ([DEBUG, "--config.model.dropout=1.5"], "model.dropout", "must be <= 1.0, got 1.5"),
    ([DEBUG, "--config.model.d_model=0"], "model.d_model", "must be >= 1, got 0"),
    # The mesh (wrong for 1 device and for 8 alike).
    ([DEBUG, "--config.mesh.data=0"], "mesh.data", "must be a positive size or -1, got 0"),
    ([DEBUG, "--config.mesh.data=-1", "--config.mesh.fsdp=-1"], "mesh.fsdp", "only one"),
    ([DEBUG, "--config.mesh.data=3"], "mesh.data", "devices"),
    # The command line.
    ([], "--config", "required"),
    ([DEBUG, "--bogus=1"], "--bogus", "unknown flag"),
    ([DEBUG, "--workdir="], "--workdir", "required"),
    ([DEBUG, "--workdir=s3://b/r", "--verify_resume", "--config.checkpoint.local_dir=fast"],
     "checkpoint.local_dir", "is for runs without a local tier"),
]

# Need 8 devices: the multidevice marker (tests/conftest.py runs these with 8 fake devices).
CASES_8_DEVICES = [
    ([DEBUG, "--config.data.batch_size=12"], "data.batch_size", "data-parallel size 8"),
    ([DEBUG, "--config.eval.batch_size=12"], "eval.batch_size", "data-parallel size 8"),
    ([DEBUG, "--config.optim.grad_accum_steps=4"], "optim.grad_accum_steps", "per-device"),
    ([DEBUG, "--config.mesh.fsdp=3"], "mesh.fsdp", "does not divide"),  # the axis set
]


@pytest.fixture(scope="module")
def cfg_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("configs")
    for name, text in CONFIG_FILES.items():
        (d / name).write_text(text)
    return d


def _ids(cases):
    return [" ".join(args)[:60] or "<no args>" for args, _, _ in cases]


def _run_in_process(args, key, why, cfg_dir, tmp_path, capfd, monkeypatch):
    def never(*a, **k):
        raise AssertionError("a bad config reached the training loop")

    # No hasattr guard: a renamed loop entry fails here instead of silently not guarding.
    monkeypatch.setattr(loop_lib, "run_loop", never)
    monkeypatch.chdir(REPO)  # configs/base.py is relative to the repo root
    workdir = tmp_path / "wd"
    argv = ["jtrain", f"--workdir={workdir}"] + [a.format(cfg=cfg_dir) for a in args]
    capfd.readouterr()
    with pytest.raises(SystemExit) as exc:
        main_lib.cli(argv)
    out, err = capfd.readouterr()
    assert exc.value.code == 2, err
    # A flag that is not a config key is a usage error (as in every jtrain command).
    kind = "usage" if key.startswith("--") and not key.startswith(("--config", "--workdir")) \
        else "config"
    _check_one_line(err, out, key.format(cfg=cfg_dir), why, kind=kind)
    _check_no_checkpoints(workdir)


def _check_one_line(err: str, out: str, key: str, why: str, kind: str = "config"):
    assert "Traceback" not in err + out, err
    assert err.endswith("\n") and err.count("\n") == 1, f"not one stderr line: {err!r}"
    prefix = f"jtrain: {kind} error: "
    assert err.startswith(prefix), err
    assert err[len(prefix):].startswith(f"{key}: "), f"expected key {key!r}: {err!r}"
    assert why and why in err, f"expected {why!r} in {err!r}"


def _check_no_checkpoints(workdir: Path):
    assert not workdir.exists() or not any(workdir.iterdir()), sorted(workdir.rglob("*"))


@pytest.mark.parametrize("args,key,why", CASES, ids=_ids(CASES))
def test_bad_config_one_line(args, key, why, cfg_dir, tmp_path, capfd, monkeypatch):
    _run_in_process(args, key, why, cfg_dir, tmp_path, capfd, monkeypatch)


@pytest.mark.multidevice
@pytest.mark.parametrize("args,key,why", CASES_8_DEVICES, ids=_ids(CASES_8_DEVICES))
def test_bad_config_for_8_devices(args, key, why, cfg_dir, tmp_path, capfd, monkeypatch):
    import jax

    assert jax.device_count() == 8
    _run_in_process(args, key, why, cfg_dir, tmp_path, capfd, monkeypatch)


def test_unknown_dataset_is_one_line(cfg_dir, tmp_path, capfd, monkeypatch):
    # jtrain.data (not config.py) checks data.name: library users may pass their own data
    # under any name. It is reported as a `data` error, still one line and exit 2.
    monkeypatch.setattr(loop_lib, "run_loop", lambda *a, **k: pytest.fail("trained"))
    monkeypatch.chdir(REPO)
    workdir = tmp_path / "wd"
    capfd.readouterr()
    with pytest.raises(SystemExit) as exc:
        main_lib.cli(["jtrain", DEBUG, f"--workdir={workdir}", "--config.data.name=nosuch"])
    out, err = capfd.readouterr()
    assert exc.value.code == 2
    _check_one_line(err, out, "data.name", "'nosuch'", kind="data")
    _check_no_checkpoints(workdir)


# The real entrypoint: `python -m jtrain.main`, cwd = the repo root.
SUBPROCESS_CASES = [
    (["--config=configs/missing.py"], {}, "configs/missing.py", "no such file"),
    ([DEBUG, "--config.optimzer.lr=1"], {}, "optimzer.lr", 'did you mean "optim"'),
    ([DEBUG, "--config.optim.lr=nan"], {}, "optim.lr", "finite"),
    ([DEBUG, "--config.data.batch_size=12"],
     {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
     "data.batch_size", "data-parallel size 8"),
]


@pytest.mark.parametrize("args,env,key,why", SUBPROCESS_CASES,
                         ids=[" ".join(c[0])[:60] for c in SUBPROCESS_CASES])
def test_entrypoint_one_line(args, env, key, why, tmp_path):
    workdir = tmp_path / "wd"
    environ = {**os.environ, "JAX_PLATFORMS": "cpu", **env}
    environ.pop("PYTHONWARNINGS", None)
    proc = subprocess.run([sys.executable, "-m", "jtrain.main", *args, f"--workdir={workdir}"],
                          cwd=REPO, env=environ, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    _check_one_line(proc.stderr, proc.stdout, key, why)
    _check_no_checkpoints(workdir)


# Positive cases: what resolve accepts.

def test_resolve_partial_dict_fills_defaults():
    cfg = config_lib.resolve({"optim": {"lr": 0.01}, "data": {"batch_size": 8}})
    want = config_lib.defaults("transformer")
    assert cfg.optim.lr == 0.01 and cfg.data.batch_size == 8
    assert cfg.total_steps == want.total_steps
    assert cfg.optim.name == want.optim.name
    assert cfg.model.d_model == want.model.d_model
    assert config_lib.resolve(None).to_dict() == want.to_dict()


def test_resolve_rejects_bad_partial_dict():
    with pytest.raises(config_lib.ConfigError) as e:
        config_lib.resolve({"optim": {"lr": math.nan}})
    assert e.value.key == "optim.lr" and str(e.value).startswith("optim.lr: ")
    with pytest.raises(config_lib.ConfigError) as e:
        config_lib.resolve({"optim": {"lrr": 0.1}})
    assert e.value.key == "optim.lrr" and 'did you mean "lr"' in str(e.value)


def _parse(*args):
    from absl import flags

    argv = ["jtrain", *args, "--workdir=unused"]
    fv = flags.FlagValues()
    main_lib.define_flags(fv, sys_argv=argv)
    main_lib.parse_flags(argv, fv)
    return fv.config


def test_override_reaches_resolved_config(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = config_lib.resolve(_parse(DEBUG, "--config.optim.lr=3e-4"))
    assert cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.total_steps == 150  # the rest of the debug variant is kept


def test_base_debug_loads_and_validates(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = config_lib.resolve(_parse(DEBUG))
    assert cfg.total_steps == 150 and cfg.data.seq_len <= cfg.model.max_len
    config_lib.validate(cfg, num_devices=1)
    config_lib.validate(cfg, num_devices=8)
    full = config_lib.resolve(_parse("--config=configs/base.py"))
    assert full.total_steps == 1500
