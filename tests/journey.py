"""Running jtrain as its users do, for the user-journey tests: a subprocess with the
venv's python, in the user's directory, with the environment a user's shell has — no
PYTHONPATH into this repository, no XLA_FLAGS faking devices, no conftest — and CPU
JAX. `python -m` and `python script.py` put the cwd / the script's folder on sys.path,
so the user's own modules import as they would for them."""

import contextlib
import os
import subprocess
import sys
import tempfile


TRUST_KEY_ENV = "JTRAIN_TRUST_KEY_FILE"  # jtrain.observe.trust: the user's signing key


def trust_key_file() -> str:
    """The suite's trust key (a temp dir, never the user's own ~/.config/jtrain): set
    once in this process's environment, so the tests in it and every subprocess they
    start sign and verify runs with the same key."""
    if not os.environ.get(TRUST_KEY_ENV):
        os.environ[TRUST_KEY_ENV] = os.path.join(tempfile.mkdtemp(prefix="jtrain-trust-"),
                                                 "trust.key")
    return os.environ[TRUST_KEY_ENV]


def user_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    return {**env, "JAX_PLATFORMS": "cpu", TRUST_KEY_ENV: trust_key_file(), **extra}


def run_python(cwd, *args, timeout: int = 300, **extra_env) -> subprocess.CompletedProcess:
    """`python *args` in `cwd` (e.g. "-m", "jtrain.main", "--config=cfg.py", ...)."""
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=user_env(**extra_env),
                          capture_output=True, text=True, timeout=timeout)


def imported_jtrain(root) -> str | None:
    """None when a journey's `import jtrain` (a temp cwd, `user_env()`) gets the jtrain of
    the checkout at `root`, else the one line saying which copy it got instead: with jtrain
    installed from elsewhere the subprocess tests would exercise that other copy."""
    expected = os.path.realpath(os.path.join(root, "jtrain", "__init__.py"))
    with tempfile.TemporaryDirectory() as cwd:
        proc = run_python(cwd, "-c", "import jtrain; print(jtrain.__file__)", timeout=120)
    got = proc.stdout.strip().splitlines()[-1:] if proc.returncode == 0 else []
    if got and os.path.realpath(got[0]) == expected:
        return None
    found = f"imports {got[0]}" if got else \
        f"cannot import jtrain ({(proc.stderr.strip().splitlines() or ['?'])[-1]})"
    return (f"{sys.executable} run as the journey tests run it {found}, not this "
            f"checkout's {expected}: run `pip install -e '.[test]'` from {root}")


PROJECTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "projects")


def copy_project(cwd, *names) -> None:
    """Copy the shared user modules `names` (tests/projects/<name>.py: nnx_mlp,
    linen_classifier) into `cwd`, where the user's script imports them as its own
    (`from nnx_mlp import Model`)."""
    import shutil

    for name in names:
        shutil.copy(os.path.join(PROJECTS, f"{name}.py"), os.path.join(str(cwd), f"{name}.py"))


def verify_resume(cwd, config: str, workdir: str, kills: int, timeout: int = 600):
    """`python -m jtrain.main --config=CONFIG --workdir=WORKDIR --verify_resume
    --verify_kills=KILLS` in `cwd`, as its user types it: the finished process and its
    `jtrain: verify_resume:` lines on stdout."""
    proc = run_python(cwd, "-m", "jtrain.main", f"--config={config}", f"--workdir={workdir}",
                      "--verify_resume", f"--verify_kills={kills}", timeout=timeout)
    return proc, [ln for ln in proc.stdout.splitlines()
                  if ln.startswith("jtrain: verify_resume:")]


def user_dir(cwd, projects=(), files=None):
    """`cwd` set up as the user's project: the shared modules `projects` copied in
    (copy_project) beside their own `files` ({name: text}: scripts, config files)."""
    copy_project(cwd, *projects)
    for name, text in (files or {}).items():
        (cwd / name).write_text(text)
    return cwd


@contextlib.contextmanager
def own_modules(*names):
    """The user's modules imported afresh from their directory by an in-process run (a
    module of that name another test imported is set aside), and forgotten after it."""
    saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    try:
        yield
    finally:
        for n in names:
            sys.modules.pop(n, None)
        sys.modules.update(saved)


def free_address() -> str:
    """`127.0.0.1:PORT` with a port free now: a coordinator address for a multi-process run."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def metric_by_step(workdir, key: str = "train/loss") -> dict:
    """{step: value} of `key` in the run's metrics.jsonl, as a user reads it."""
    import json

    with open(os.path.join(str(workdir), "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: r[key] for r in rows if key in r}


@contextlib.contextmanager
def s3_server(*buckets: str):
    """A real S3-protocol server (moto's server mode) on 127.0.0.1 and a free port, with
    `buckets` created; yields (server, env): `env` is what a user's shell sets for it
    (AWS_ENDPOINT_URL, dummy credentials, no config file of this machine's), for
    run_python(..., **env) and for the test's own client (set in os.environ meanwhile).
    The buckets' contents live in this process (moto's backend) across a server's stop
    and a new server on the same port."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing-secret-value", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
           "AWS_EC2_METADATA_DISABLED": "true"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        import fsspec

        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        for bucket in buckets:
            fs.mkdir(bucket)
        yield server, env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        with contextlib.suppress(Exception):  # a test may have stopped it already
            server.stop()


def nnx_mlp_config(total_steps: int, eval_every: int, log_every: int,
                   checkpoint_every: int) -> str:
    """A user's cfg.py for tests/projects/nnx_mlp.py (batch 8, lr 0.05 after one warmup
    step, decaying until step 20 whatever total_steps is: every file that uses it shares
    one compiled train step; one eval batch, jsonl metrics, a state hash every step)."""
    return f'''
from jtrain.config import defaults


def get_config():
    c = defaults(model="user")
    c.model.factory = "nnx_mlp:make"
    c.data.source = "nnx_mlp:data"
    c.data.batch_size = 8
    c.total_steps = {total_steps}
    c.optim.update(lr=0.05, warmup_steps=1, decay_steps=20)
    c.eval.update(every_steps={eval_every}, num_batches=1)
    c.log.update(every_steps={log_every}, writers=("jsonl",))
    c.checkpoint.every_steps = {checkpoint_every}
    c.debug.hash_every_steps = 1
    return c
'''


def marked_block(page, test_file: str) -> str:
    """The python block of docs page `page` marked `<!-- tested: TEST_FILE -->`, as a
    user copies it."""
    with open(page, encoding="utf-8") as f:
        text = f.read()
    block = text.split(f"<!-- tested: {test_file} -->\n```python\n", 1)[1]
    return block.split("```", 1)[0]


def verify_resume_against(cwd, argv, root: str, reference: str, kills: int = 1,
                          timeout: int = 600):
    """jtrain's resume verifier (`jtrain.verify.resume.verify_resume`, what
    `--verify_resume` runs) on the user's command `python ARGV --workdir=ROOT/interrupted`
    in `cwd`: SIGKILLed `kills` times and restarted with the same command, then compared
    with `reference`, a run finished already. Paths relative to `cwd`. Returns the
    verdict (.ok, .line)."""
    from jtrain.verify import resume as verify

    def command(run_dir):
        return [sys.executable, *map(str, argv), f"--workdir={run_dir}"]

    with contextlib.chdir(cwd):
        return verify.verify_resume(command, root, kills=kills, reference=reference,
                                    env=user_env(), timeout=timeout)


def killed_and_restarted(cwd, config, argv, root: str, kills: int = 1, modules=()):
    """The user's command `python ARGV` (its --workdir left out) in `cwd`, SIGKILLed
    `kills` times and restarted by jtrain's resume verifier, checked bitwise identical to
    `config` trained straight through in this process into ROOT/reference (the same run
    as a reference launch of its own, without repeating the imports): the verdict must
    be a PASS with every kill landed. Returns the command's run directory,
    CWD/ROOT/interrupted. `modules`: as for train_in_process."""
    import pathlib

    train_in_process(cwd, config, f"{root}/reference", modules)
    verdict = verify_resume_against(cwd, argv, root, f"{root}/reference", kills=kills)
    log = pathlib.Path(cwd) / root / "interrupted.log"
    assert verdict.ok and verdict.line.startswith(
        f"PASS: bitwise identical after {kills}/{kills} kills landed"), \
        verdict.line + "\n" + log.read_text()[-3000:]
    return pathlib.Path(cwd) / root / "interrupted"


def train_in_process(cwd, config, workdir: str, modules=()):
    """`jtrain.train(config, workdir)` in this process as if run from `cwd` (the user's
    modules importable from it): the result. `modules`: the names of the user's modules
    the config imports (own_modules: other tests have modules of the same names in their
    own directories)."""
    import jtrain

    sys.path.insert(0, str(cwd))
    try:
        with own_modules(*modules), contextlib.chdir(cwd):
            return jtrain.train(config, workdir)
    finally:
        sys.path.remove(str(cwd))
