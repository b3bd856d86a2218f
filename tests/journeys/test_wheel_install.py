"""jtrain as a wheel, run where it is installed: the wheel built from this tree carries
every module of the package, the reference and recipe configs (jtrain/configs/), its
metadata (one version, the license, ranges rather than pins) and a LICENSE; installed
into a fresh venv, it trains `--config=base:debug` by name and a user's own model script
from a directory outside the checkout, with the `jtrain` console script the wheel installed.

The venv gets only the wheel (`pip install --no-deps`); its dependencies are this test's
own environment's, seen through a `.pth` file (a venv made from a venv with
`--system-site-packages` sees the base interpreter's packages, not ours). Installing the
dependencies themselves from the lock (`pip install -c constraints.txt jtrain-*.whl` into
a bare venv) took about a minute with every wheel on local disk, too long for one test:
WORKSPACE.md gives that check as a command.

The lock holds the newest jax and flax, while the ranges let a user keep older ones: the
one venv (shared by the tests; its three commands run once) holds the lower bounds of jax, jaxlib
and flax from `pyproject.toml` in its own site-packages (from pip's cache or the package
index; the `.pth` comes after them, so they win over the lock's), and the debug
reference run and the user's script train there. The lock's own versions train the rest
of the suite."""

import email
import json
import os
import re
import shutil
import site
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import jtrain
from journey import user_env

REPO = Path(__file__).resolve().parents[2]

USER_SCRIPT = '''
import json

import flax
import jax
import jaxlib
import numpy as np
from flax import nnx

import jtrain


class Net(nnx.Module):  # the user's own model, in the user's own file
    def __init__(self, rngs):
        self.hidden = nnx.Linear(4, 16, rngs=rngs)
        self.out = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


rng = np.random.default_rng(0)
X = rng.normal(size=(256, 4)).astype(np.float32)
Y = (X[:, 0] > X[:, 1]).astype(np.int32)
cfg = {"total_steps": 5, "data": {"batch_size": 32}, "optim": {"lr": 1e-2},
       "eval": {"every_steps": 0}, "checkpoint": {"every_steps": 0}}
result = jtrain.train(cfg, "runs/mine", model=Net(nnx.Rngs(0)),
                      train_data={"inputs": X[:224], "targets": Y[:224]},
                      eval_data={"inputs": X[224:], "targets": Y[224:]})
print(json.dumps({"step": result.summary["step"], "versions": {
    m.__name__: [m.__version__, m.__file__] for m in (jax, jaxlib, flax, jtrain)}}))
'''


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of a copy of what the build reads (the package, pyproject, README, LICENSE)."""
    tmp_path = tmp_path_factory.mktemp("build")
    src, wheels = tmp_path / "src", tmp_path / "wheels"
    shutil.copytree(REPO / "jtrain", src / "jtrain",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "-q", "-w", str(wheels), str(src)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = wheels.glob("jtrain-*.whl")
    return wheel


def _pip_install(venv: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin/python"),
                           "install", "-q", "--no-deps", *args],
                          capture_output=True, text=True, timeout=300)


def _venv_with(wheel: Path, tmp_path: Path, own: tuple[str, ...] = ()) -> Path:
    """A venv holding the wheel and the requirements `own` (from pip's cache or the index),
    seeing everything else in this environment through a `.pth` read after its own."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    (new_site,) = (venv / "lib").glob("python3*/site-packages")
    deps = [p for p in site.getsitepackages() if p.endswith("site-packages")]
    (new_site / "zz_deps.pth").write_text("\n".join(deps) + "\n")  # after the venv's own
    if own:
        fetched = _pip_install(venv, "--only-binary=:all:", "--no-compile", *own)
        assert fetched.returncode == 0, (  # no network: a failure, never a skip
            f"could not install {' '.join(own)} from pip's cache or the package index "
            f"(the test needs the index or those wheels in the cache): {fetched.stderr[-2000:]}")
    install = _pip_install(venv, "--no-index", str(wheel))
    assert install.returncode == 0, install.stderr[-3000:]
    return venv


def _lower_bounds(*names: str) -> dict[str, str]:
    """The `>=` bound of each name among pyproject.toml's dependencies."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    bounds = {m[1]: m[2] for d in deps if (m := re.match(r"([\w-]+)>=([\w.]+)", d))}
    return {n: bounds[n] for n in names}


def test_the_wheel_carries_the_configs_the_license_and_ranges(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = email.message_from_bytes(z.read(f"jtrain-{jtrain.__version__}.dist-info/METADATA"))
        packaged = {n for n in names if n.startswith("jtrain/configs/") and n.endswith(".py")}
        checkout = {f"jtrain/configs/{p.relative_to(REPO / 'configs')}"
                    for p in (REPO / "configs").rglob("*.py")}
        assert packaged == checkout and "jtrain/configs/recipes/classify.py" in packaged
        assert all(z.read(n) == (REPO / n).read_bytes() for n in packaged)  # one copy
        modules = {p.relative_to(REPO).as_posix() for p in (REPO / "jtrain").rglob("*.py")
                   if "__pycache__" not in p.parts}
        assert modules <= names, sorted(modules - names)  # no module left out of the package
        (license_file,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert "Apache License" in z.read(license_file).decode()
    assert meta["Version"] == jtrain.__version__  # the one version string
    assert meta["License-Expression"] == "Apache-2.0" and meta["Author"] == "jtrain authors"
    requires = meta.get_all("Requires-Dist")
    core = [r for r in requires if "extra ==" not in r]
    assert any(r.startswith("jax<") for r in core), core
    for r in core:  # a range with a lower bound, never a pin: installable beside anything
        assert ">=" in r and "==" not in r, r
    assert "torch==2.13.0; extra == \"torch\"" in requires  # the one exact pin: a CPU build


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> dict:
    """One venv holding the wheel and the lower bounds of jax, jaxlib and flax, used from a
    directory outside the checkout: `jtrain train --config=base:debug` (a packaged config
    by name), a misspelt name, and the user's own model script."""
    tmp_path = tmp_path_factory.mktemp("installed")
    lowest = _lower_bounds("jax", "jaxlib", "flax")
    venv = _venv_with(wheel, tmp_path, own=tuple(f"{n}=={v}" for n, v in lowest.items()))
    user = tmp_path / "user"
    user.mkdir()
    env = user_env()

    def run(*argv):
        return subprocess.run([str(a) for a in argv], cwd=user, env=env, capture_output=True,
                              text=True, timeout=300)

    trained = run(venv / "bin" / "jtrain", "train", "--config=base:debug", "--workdir=runs/x",
                  "--config.total_steps=3", "--config.eval.num_batches=1")
    listing = sorted(os.listdir(user))
    typo = run(venv / "bin" / "jtrain", "train", "--config=bsae:debug", "--workdir=runs/y")
    (user / "mine.py").write_text(USER_SCRIPT)
    mine = run(venv / "bin" / "python", "mine.py")
    return {"venv": venv, "user": user, "lowest": lowest, "trained": trained,
            "listing": listing, "typo": typo, "mine": mine}


def test_the_installed_wheel_runs_packaged_configs_by_name_outside_the_checkout(installed):
    user, trained, typo = installed["user"], installed["trained"], installed["typo"]
    assert trained.returncode == 0, trained.stderr[-3000:]
    summary = json.loads((user / "runs/x/summary.json").read_text())
    assert summary["step"] == 3 and summary["exit_code"] == 0, summary
    config = json.loads((user / "runs/x/config.json").read_text())
    assert config["model"]["d_model"] == 64 and config["total_steps"] == 3  # base's debug
    assert installed["listing"] == ["runs"]  # no configs/ needed beside the run

    assert typo.returncode == 2, typo.stderr[-3000:]
    assert typo.stderr.strip().splitlines()[-1].startswith(
        "jtrain: config error: bsae: no such file, nor a packaged config (one of: base, ")


def test_the_wheel_trains_beside_the_lowest_jax_and_flax_outside_the_checkout(installed):
    venv, mine = installed["venv"], installed["mine"]
    assert mine.returncode == 0, mine.stderr[-3000:]
    out = json.loads(mine.stdout.strip().splitlines()[-1])
    assert out["step"] == 5, out
    assert (installed["user"] / "runs/mine/summary.json").is_file()
    used = out["versions"]
    for name, version in installed["lowest"].items():  # the venv's own copies, not the lock's
        assert used[name][0] == version and used[name][1].startswith(str(venv)), used
    assert used["jtrain"][1].startswith(str(venv)), used  # the wheel, not the checkout
