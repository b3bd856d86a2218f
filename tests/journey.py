"""Running jtrain as its users do, for the user-journey tests: a subprocess with the
venv's python, in the user's directory, with the environment a user's shell has — no
PYTHONPATH into this repository, no XLA_FLAGS faking devices, no conftest — and CPU
JAX. `python -m` and `python script.py` put the cwd / the script's folder on sys.path,
so the user's own modules import as they would for them."""

import os
import subprocess
import sys


def user_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    return {**env, "JAX_PLATFORMS": "cpu", **extra}


def run_python(cwd, *args, timeout: int = 300, **extra_env) -> subprocess.CompletedProcess:
    """`python *args` in `cwd` (e.g. "-m", "jtrain.main", "--config=cfg.py", ...)."""
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=user_env(**extra_env),
                          capture_output=True, text=True, timeout=timeout)
