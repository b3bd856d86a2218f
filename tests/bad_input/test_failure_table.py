"""Every failure a person meets at the command line is one line on stderr with its exit
code (jtrain/errors.py), and nothing printed or written leaks a secret.

CASES is a table of bad command lines and environments, typed as a user types them
(`jtrain <command> ...`, relative paths, a user directory as cwd): bad flags, bad config
files (one that raises KeyError, one that calls sys.exit), bad overrides, a workdir that
is a file, on a read-only file system or on a full one, at start-up or when a
checkpoint is written mid-run (small tmpfs mounts: the tests run as root; without mount
rights those rows skip), bad environment variables, and
the other commands' mistakes. Each row asserts: its exit code, exactly one line on
stderr starting with `jtrain: <kind> error:` and containing the row's text, no
`Traceback` anywhere, and nothing written to stdout.

The rows run as real processes: one server process imports jtrain (and what its
commands import) once and forks a child per row (the child chdirs, sets the row's environment,
points fd 1 and 2 at files and calls the `jtrain` console script's main), so the table costs one
interpreter start-up, not thirty. test_console_script_* run the installed script itself.

test_secrets_never_leak plants secrets in config keys (data.kwargs.auth /
.passphrase / .private_key), the environment, a data factory's error text and an
init_from URI, runs a short training run, a failing one and a failing init_from, and
greps stdout, stderr and every file of the workdirs for them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from journey import user_env

REPO = Path(__file__).resolve().parents[2]
DEBUG = "--config=configs/base.py:debug"

CONFIG_FILES = {
    "syntax.py": "def get_config(:\n",
    "raises_key.py": "def get_config():\n    table = {}\n    return table['lr']\n",
    "exits.py": "import sys\n\ndef get_config():\n    sys.exit(3)\n",
}

SECRETS = {"auth": "S3cr3tAuthValue1", "passphrase": "S3cr3tPassphrase2",
           "private_key": "S3cr3tPrivKey3", "env": "S3cr3tEnvToken4", "uri": "S3cr3tUriPass5"}

USER_DATA = '''
"""A user's data factory (data.source) and a tiny model config for the secret test."""
import os

import ml_collections
import numpy as np
from jtrain.config import defaults


def make(auth="", passphrase="", private_key="", fail=False):
    if fail:  # an error that echoes what it was given
        raise ValueError(f"login refused for {auth} {passphrase} {private_key} "
                         f"token={os.environ.get('MY_API_TOKEN')}")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    return {"train": {"inputs": x, "targets": y}, "eval": {"inputs": x[:16], "targets": y[:16]}}


def get_config():
    c = defaults(model="mlp")
    c.model.hidden = (8,)
    c.model.num_outputs = 2
    c.total_steps = 4
    c.data.batch_size = 8
    c.data.source = "user_data:make"
    c.eval.every_steps = 2
    c.log.every_steps = 2
    c.checkpoint.every_steps = 2
    return c
'''

# (id, argv after `jtrain`, extra environment, exit code, text in the one line).
# "{mount:ro}" / "{mount:full}" rows need a tmpfs mount (root); "afile" is a file.
CASES = [
    ("no_args", ["train"], {}, 2, "config error: --config: required"),
    ("no_workdir", ["train", DEBUG], {}, 2, "config error: --workdir: required"),
    ("unknown_flag", ["train", DEBUG, "--workdir=runs/a", "--bogus=1"], {}, 2,
     "usage error: --bogus: unknown flag"),
    ("positional", ["train", DEBUG, "--workdir=runs/a", "extra"], {}, 2,
     "usage error: unexpected arguments: extra"),
    ("verbosity_range", ["train", DEBUG, "--workdir=runs/a", "--verbosity=5"], {}, 2,
     "usage error: --verbosity: 5 is not an integer in the range [0, 2]"),
    ("config_missing", ["train", "--config=nope.py", "--workdir=runs/a"], {}, 2,
     "config error: nope.py: no such file"),
    ("config_syntax", ["train", "--config=syntax.py", "--workdir=runs/a"], {}, 2,
     "config error: syntax.py: syntax error at line 1"),
    ("config_keyerror", ["train", "--config=raises_key.py", "--workdir=runs/a"], {}, 2,
     "config error: raises_key.py: KeyError: 'lr'"),
    ("config_sys_exit", ["train", "--config=exits.py", "--workdir=runs/a"], {}, 2,
     "config error: exits.py: get_config() called sys.exit(3)"),
    ("config_variant", ["train", "--config=configs/base.py:bogus", "--workdir=runs/a"], {},
     2, "config error: configs/base.py: unknown variant 'bogus'"),
    ("override_typo", ["train", DEBUG, "--workdir=runs/a", "--config.optimzer.lr=1"], {}, 2,
     'config error: optimzer.lr: unknown key; did you mean "optim"?'),
    ("override_type", ["train", DEBUG, "--workdir=runs/a", "--config.total_steps=abc"], {},
     2, "config error: total_steps: must be an integer, got 'abc'"),
    ("override_range", ["train", DEBUG, "--workdir=runs/a", "--config.total_steps=0"], {},
     2, "config error: total_steps: must be >= 1, got 0"),
    ("mesh_axis", ["train", DEBUG, "--workdir=runs/a", "--config.mesh.tensor=3"], {}, 2,
     "config error: mesh.tensor: "),
    ("kwargs_not_dict", ["train", DEBUG, "--workdir=runs/a", "--config.data.kwargs=3"], {},
     2, "config error: data.kwargs: "),
    ("print_config_bad", ["train", DEBUG, "--config.optim.lr=-1", "--print_config"], {}, 2,
     "config error: optim.lr: must be >= 0.0, got -1.0"),
    ("data_source", ["train", DEBUG, "--workdir=runs/a", "--config.data.source=nomod:fn"],
     {}, 2, "data error: data.source: cannot import 'nomod'"),
    ("init_from_missing", ["train", DEBUG, "--workdir=runs/a",
                           "--config.init.path=exports/none"], {}, 2,
     "config error: init.path: exports/none: no such file or directory"),
    ("workdir_is_file", ["train", DEBUG, "--workdir=afile"], {}, 2,
     "workdir error: "),
    ("workdir_under_file", ["train", DEBUG, "--workdir=afile/run"], {}, 2,
     "is a file, not a directory"),
    ("workdir_read_only", ["train", DEBUG, "--workdir={mount:ro}/run"], {}, 2,
     "is not writable (read-only file system)"),
    ("disk_full", ["train", "--config=user_data.py", "--workdir={mount:full}/run"], {}, 6,
     "disk error: no space left on the device"),
    # A checkpoint (3 MB: an MLP of 512 x 512) that does not fit on a 1 MB disk, written
    # in orbax's background threads after two steps: orbax's error logs and tracebacks
    # go to train.log, the console (--verbosity=0: errors only) gets the one line.
    ("disk_full_mid_run", ["train", "--config=user_data.py", "--workdir={mount:small}/run",
                           "--config.model.hidden=(512, 512)", "--verbosity=0"], {}, 6,
     "disk error: no space left on the device holding small/run (saving checkpoint step 2"),
    ("env_num_processes", ["train", DEBUG, "--workdir=runs/a"],
     {"JTRAIN_NUM_PROCESSES": "two"}, 2,
     "usage error: JTRAIN_NUM_PROCESSES='two' in the environment: expected an integer"),
    ("no_coordinator", ["train", DEBUG, "--workdir=runs/a", "--num_processes=2"], {}, 2,
     "config error: --coordinator_address: required when --num_processes > 1"),
    ("evaluate_no_workdir", ["evaluate"], {}, 2, "usage error: --workdir: required"),
    ("evaluate_missing", ["evaluate", "--workdir=runs/nope"], {}, 2,
     "evaluate error: --workdir: "),
    ("evaluate_bad_flag", ["evaluate", "--workdir=runs/nope", "--num_batches=x"], {}, 2,
     "usage error: --num_batches: must be an integer, got 'x'"),
    ("export_missing", ["export", "--workdir=runs/nope", "--out=exports/x"], {}, 3,
     "export error: runs/nope: "),
    ("export_twice", ["export", "runs/a", "--workdir=runs/b", "--out=exports/x"], {}, 2,
     "usage error: --workdir=runs/b and the positional runs/a: give the run once"),
    ("export_no_out", ["export", "--workdir=runs/a"], {}, 2,
     "usage error: --out: required"),
    # jtrain tokenize's input and the token shards a run reads (set up in `table`)
    ("tokenize_jsonl", ["tokenize", "--input=posts.jsonl", "--out=shards/new"], {}, 2,
     "data error: posts.jsonl:2: not JSON ("),
    ("tokens_index_cut", ["train", DEBUG, "--workdir=runs/t1", "--config.data.name=tokens",
                          "--config.data.path=shards/cut"], {}, 2,
     "/index.json: not a token index (cut short or not JSON: "),
    ("tokens_index_escapes", ["train", DEBUG, "--workdir=runs/t2",
                              "--config.data.name=tokens",
                              "--config.data.path=shards/escapes"], {}, 2,
     "/index.json: shards[0].file: '../afile' is not a file name inside the folder"),
    ("tokens_index_mistyped", ["train", DEBUG, "--workdir=runs/t3",
                               "--config.data.name=tokens",
                               "--config.data.path=shards/mistyped"], {}, 2,
     "/index.json: shards[0].tokens: '9' is not a non-negative integer"),
    ("tokens_shard_short", ["train", DEBUG, "--workdir=runs/t4", "--config.data.name=tokens",
                            "--config.data.path=shards/short"], {}, 2,
     "/shard-00000.bin: 16 bytes, index.json says 600 tokens of 2 bytes"),
    ("bench_unknown", ["bench", "nosuch"], {}, 2,
     "usage error: unknown benchmark 'nosuch'"),
    ("command_typo", ["trian"], {}, 2, "usage error: jtrain trian: unknown command; choose "
     'from train, evaluate, export, tune, bench, diff, replay, trust, sample, tokenize (did '
     'you mean "train"?)'),
    # Writers that cannot start: found before the data, the build or any step; an
    # existing run's files are left as they were (test_writer_failures_keep_the_run).
    ("writer_mlflow_file_store", ["train", DEBUG, "--workdir=runs/mlf",
                                  "--config.log.writers=mlflow",
                                  "--config.log.mlflow_tracking_uri=file:mlruns"], {}, 2,
     "config error: log.mlflow_tracking_uri: MLflow refuses a file: store unless "
     "MLFLOW_ALLOW_FILE_STORE=true is set; use sqlite:///"),
    ("writer_tensorboard_dir", ["train", DEBUG, "--workdir=runs/tbfile"], {}, 2,
     "config error: log.writers: tensorboard cannot write its event files to "),
    ("writer_wandb_dir", ["train", DEBUG, "--workdir=runs/wbfile",
                          "--config.log.writers=wandb"], {"WANDB_SILENT": "true"}, 2,
     "config error: log.writers: wandb cannot write its offline run to "),
]

# The secret test's runs: (id, argv after `jtrain`).
_PLANTED = [f"--config.data.kwargs.auth={SECRETS['auth']}",
            f"--config.data.kwargs.passphrase={SECRETS['passphrase']}",
            f"--config.data.kwargs.private_key={SECRETS['private_key']}"]
SECRET_RUNS = [
    ("secret_ok", ["train", "--config=user_data.py", "--workdir=runs/secret", *_PLANTED]),
    ("secret_factory", ["train", "--config=user_data.py", "--workdir=runs/secret_fail",
                        *_PLANTED, "--config.data.kwargs.fail=true"]),
    ("secret_init_from", ["train", "--config=user_data.py", "--workdir=runs/secret_init",
                          *_PLANTED, "--config.init.path="
                          f"https://bob:{SECRETS['uri']}@store.example/run"]),
    ("secret_print", ["train", "--config=user_data.py", *_PLANTED, "--print_config"]),
]

# Rows that need the secret test's finished run (they run after SECRET_RUNS).
LATE_CASES = [
    ("export_read_only", ["export", "--workdir=runs/secret", "--out={mount:ro}/x"], {}, 2,
     "workdir error: ro/x: read-only file system"),
    ("export_disk_full", ["export", "--workdir=runs/secret", "--out={mount:full}/x"], {}, 6,
     "disk error: no space left on the device"),
]

SERVER = textwrap.dedent('''
    import json, os, sys, time
    # The imports, once (what `jtrain train|evaluate|export` import; nothing printed: the
    # test checks this process's stderr); JAX's backend starts in the children.
    import jtrain.cli, jtrain.main, jtrain.evaluate, jtrain.export
    from jax._src import xla_bridge
    assert not xla_bridge._backends, "a backend started before the fork"
    results = []
    for case in json.load(sys.stdin):
        sys.stdout.flush()
        sys.stderr.flush()
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            code = 99
            try:
                os.chdir(case["cwd"])
                os.environ.update(case["env"])
                for fd, name in ((1, "stdout"), (2, "stderr")):
                    out = os.open(os.path.join(case["out"], name),
                                  os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                    os.dup2(out, fd)
                sys.argv = ["jtrain", *case["argv"]]
                code = jtrain.cli.main(case["argv"])
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        results.append([code, round(time.monotonic() - t0, 2)])
    print(json.dumps(results))
''')


def _mount(path: Path, options: str) -> bool:
    path.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True, text=True)
    return proc.returncode == 0


def _fill(path: Path) -> None:
    """Writes a file until the tmpfs is full (ENOSPC)."""
    fd = os.open(path / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)


def _token_shards(user) -> None:
    """posts.jsonl (line 2 cut short) and four copies of a folder of byte shards under
    shards/: index.json cut in half, naming a file outside the folder (re-fingerprinted,
    as a hostile writer would), a token count that is a string, a shard cut short."""
    from jtrain.data import tokenizer as tokenizer_lib, tokens

    (user / "posts.jsonl").write_text('{"text": "one"}\n{"text": "two\n')
    good = user / "shards" / "good"
    good.mkdir(parents=True)
    tokens.write_shards(tokenizer_lib.load("byte"), ["x" * 1500], str(good), 600)
    index = json.loads((good / "index.json").read_text())
    for name in ("cut", "escapes", "mistyped", "short"):
        shutil.copytree(good, user / "shards" / name)
    (user / "shards/cut/index.json").write_text((good / "index.json").read_text()[:200])
    for name, field, value in (("escapes", "file", "../afile"), ("mistyped", "tokens", "9")):
        bad = json.loads(json.dumps(index))
        bad["shards"][0][field] = value
        bad["fingerprint"] = tokens.fingerprint(bad)
        (user / "shards" / name / "index.json").write_text(json.dumps(bad))
    (user / "shards/short/shard-00000.bin").write_bytes(b"x" * 16)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """Runs every row (CASES and SECRET_RUNS) once; {id: (exit code, stdout, stderr)}."""
    user = tmp_path_factory.mktemp("user")
    shutil.copytree(REPO / "configs", user / "configs")
    for name, text in CONFIG_FILES.items():
        (user / name).write_text(text)
    (user / "user_data.py").write_text(USER_DATA)
    (user / "afile").write_text("not a run")
    _token_shards(user)
    for run, blocker in (("tbfile", "tb"), ("wbfile", "wandb")):  # a file where a writer's
        (user / "runs" / run).mkdir(parents=True)                  # folder goes
        (user / "runs" / run / blocker).write_text("not a folder")
        (user / "runs" / run / "metrics.jsonl").write_text('{"step": 5}\n')
    mounts = {}
    try:
        if _mount(user / "ro", "ro,size=64k"):
            mounts["ro"] = user / "ro"
        if _mount(user / "full", "size=64k"):
            mounts["full"] = user / "full"
            _fill(user / "full")
        if _mount(user / "small", "size=1m"):
            mounts["small"] = user / "small"
        return _run_table(user, mounts)
    finally:
        for m in mounts.values():
            subprocess.run(["umount", str(m)], capture_output=True)


def _run_table(user: Path, mounts: dict):
    jobs, skipped = [], {}
    mounts_used = ("ro", "full", "small")
    env = {"MY_API_TOKEN": SECRETS["env"], "JAX_PLATFORMS": "cpu"}
    for case_id, argv, extra, *_ in [*CASES, *[(i, a, {}) for i, a in SECRET_RUNS],
                                     *LATE_CASES]:
        needs = [m for m in mounts_used if any(f"{{mount:{m}}}" in a for a in argv)]
        if any(m not in mounts for m in needs):
            skipped[case_id] = "mounting a tmpfs needs root (CAP_SYS_ADMIN)"
            continue
        for m in mounts_used:
            argv = [a.replace(f"{{mount:{m}}}", m) for a in argv]
        out = user / "out" / case_id
        out.mkdir(parents=True)
        jobs.append({"id": case_id, "argv": argv, "env": {**env, **extra}, "cwd": str(user),
                     "out": str(out)})
    proc = subprocess.run([sys.executable, "-c", SERVER], input=json.dumps(jobs), cwd=user,
                          env=user_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == "", proc.stderr[-3000:]  # importing jtrain printed nothing
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    print("row seconds:",  # -s shows it
          {job["id"]: t for job, (_, t) in zip(jobs, codes, strict=True)})
    results = {job["id"]: (code, Path(job["out"], "stdout").read_text(),
                           Path(job["out"], "stderr").read_text())
               for job, (code, _) in zip(jobs, codes, strict=True)}
    return results, skipped, user


@pytest.mark.parametrize("case_id,argv,env,code,text", CASES + LATE_CASES,
                         ids=[c[0] for c in CASES + LATE_CASES])
def test_failure_is_one_line_with_its_exit_code(table, case_id, argv, env, code, text):
    results, skipped, _ = table
    if case_id in skipped:
        pytest.skip(skipped[case_id])
    got, stdout, stderr = results[case_id]
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert "Traceback" not in stderr + stdout, stderr[-3000:]
    assert len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith("jtrain: ") and " error: " in lines[0], lines[0]
    assert text in lines[0], lines[0]
    assert got == code, (got, lines[0])
    assert stdout == "", stdout  # errors go to stderr only


def test_at_least_25_rows():
    assert len(CASES + LATE_CASES) >= 25


def test_failures_leave_no_run_behind(table):
    """A failure before training saves nothing that looks like a started run (a missing
    init_from is found after WORKDIR/checkpoints/ is created: it stays empty)."""
    _, _, user = table
    run = user / "runs" / "a"
    assert not (run / "config.json").exists() and not (run / "metrics.jsonl").exists()
    assert not list(run.glob("checkpoints/*"))
    assert not (user / "exports").exists()  # a failed export writes nothing
    assert (user / "afile").read_text() == "not a run"  # a file as workdir is left alone


def test_writer_failures_keep_the_run(table):
    """A writer that cannot start fails before anything of the run is written: the
    existing metrics.jsonl is untouched, no config.json, no MLflow store appears."""
    _, _, user = table
    for run in ("tbfile", "wbfile"):
        assert sorted(p.name for p in (user / "runs" / run).iterdir()) == sorted(
            ["metrics.jsonl", "tb" if run == "tbfile" else "wandb"])
        assert (user / "runs" / run / "metrics.jsonl").read_text() == '{"step": 5}\n'
    assert not (user / "mlruns").exists() and not (user / "runs" / "mlf").exists()


def test_secrets_never_leak(table):
    results, _, user = table
    code, stdout, stderr = results["secret_ok"]
    assert code == 0, stderr[-3000:]
    assert json.loads(stdout.strip().splitlines()[-1])["step"] == 4  # the result, on stdout
    code, _, stderr = results["secret_factory"]
    assert code == 2 and stderr.count("\n") == 1, stderr
    assert stderr.startswith("jtrain: data error: data.source: "), stderr
    assert "<redacted>" in stderr
    code, _, stderr = results["secret_init_from"]
    assert code == 2 and "https://<redacted>@store.example/run" in stderr, stderr
    code, stdout, _ = results["secret_print"]
    assert code == 0 and "data.kwargs = {" in stdout and "<redacted>" in stdout
    texts = [f"{i}: {out}\n{err}" for i, (_, out, err) in results.items()]
    for root in ("runs/secret", "runs/secret_fail", "runs/secret_init"):
        for path in (user / root).rglob("*"):
            if path.is_file():
                texts.append(f"{path}: " + path.read_bytes().decode("utf-8", "replace"))
    assert any("runs/secret/" in t and "config.json" in t for t in texts)
    for name, secret in SECRETS.items():
        leaks = [t.split(":", 1)[0] for t in texts if secret in t]
        assert not leaks, f"the {name} secret leaked into {leaks}"
