"""Every public entry point run as its user runs it: a subprocess of the venv's python in
an empty temp directory, relative paths only, jtrain imported as installed (no
PYTHONPATH, no conftest, absl flags parsed by nobody), one CPU device. Each test asserts
what the user sees: the exit code, the one line, the files written.

One small run (`python -m jtrain.main` with the user's own config file) is trained once
for the module; evaluate, export, init_from and the rerun read it. (`--verify_resume
--verify_kills=2` on this config: tests/journeys/test_optimizers_journey.py, whose
schedule-free run it verifies.)"""

import concurrent.futures
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from journey import run_python

CONFIG = '''
from jtrain.config import defaults


def get_config():
    c = defaults(model="transformer")
    c.seed = 0
    c.total_steps = 6
    c.model.update(d_model=32, num_layers=1, num_heads=2, d_ff=64, max_len=32)
    c.data.update(name="pystdlib", seq_len=32, batch_size=8)
    c.optim.warmup_steps = 1
    c.eval.every_steps = 3
    c.eval.num_batches = 2
    c.log.every_steps = 2
    c.checkpoint.every_steps = 3
    return c
'''


def one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def read_json(path):
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def user_run(tmp_path_factory):
    """(cwd, the finished process) of `python -m jtrain.main --config=cfg.py
    --workdir=runs/x` in an empty directory."""
    cwd = tmp_path_factory.mktemp("user")
    (cwd / "cfg.py").write_text(CONFIG)
    proc = run_python(cwd, "-m", "jtrain.main", "--config=cfg.py", "--workdir=runs/x")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd, proc


def test_main_trains_from_an_empty_directory_with_relative_paths(user_run):
    cwd, proc = user_run
    run = cwd / "runs" / "x"
    summary = read_json(run / "summary.json")
    assert summary["step"] == 6 and len(summary["state_sha256"]) == 64
    assert sorted(os.listdir(run / "checkpoints")) == ["3", "6"]
    for name in ("config.json", "metrics.jsonl", "train.log"):
        assert (run / name).is_file(), name
    steps = [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]
    assert 6 in steps
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in cwd.iterdir()) == ["cfg.py", "runs"]  # nothing elsewhere


def test_evaluate_export_and_init_from_read_a_relative_run(user_run, monkeypatch, capfd):
    """`jtrain.export runs/x` and `init.path=runs/x` crashed on a relative
    path; they run side by side here (three processes, one read-only source), then a
    fine-tune starts from the relative export."""
    cwd, _ = user_run
    commands = {
        "evaluate": ("-m", "jtrain.evaluate", "--workdir=runs/x", "--step=best", "--noplots",
                     "--num_batches=2"),
        "export": ("-m", "jtrain.export", "runs/x", "--out=exports/x", "--dtype=bfloat16"),
        # decay_steps: the schedule of runs/x, so its compiled train step serves this run
        "init_from": ("-m", "jtrain.main", "--config=cfg.py", "--workdir=runs/ft",
                      "--config.total_steps=2", "--config.optim.decay_steps=6",
                      "--config.init.path=runs/x"),
    }
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        procs = {k: pool.submit(run_python, cwd, *a) for k, a in commands.items()}
        procs = {k: f.result() for k, f in procs.items()}
    for name, proc in procs.items():
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr, name
    report = read_json(cwd / "runs" / "x" / "eval_6.json")
    assert report["step"] == 6 and report["metrics"]["eval/loss"] > 0
    assert procs["export"].stdout.startswith("jtrain: exported step 6:")
    assert (cwd / "exports" / "x" / "params.safetensors").is_file()
    ft = read_json(cwd / "runs" / "ft" / "summary.json")
    assert ft["step"] == 2
    said = [ln for ln in procs["init_from"].stderr.splitlines() if "initialized from" in ln]
    # the init_from report (the checkpoint read, relative as typed) and the header's origin
    assert len(said) == 2 and "runs/x/checkpoints/6" in said[0], procs["init_from"].stderr
    assert said[1].endswith("; initialized from runs/x (step 6, 10 leaves, 0 excluded)")
    # ... and from the export just written (bfloat16, cast back to the model's float32),
    # through jtrain.train in this process (the command line's form: just above)
    import runpy

    import jtrain

    monkeypatch.chdir(cwd)
    config = runpy.run_path("cfg.py")["get_config"]()
    config.total_steps, config.optim.decay_steps = 2, 6
    config.init.path = "exports/x"
    result = jtrain.train(config, "runs/ft2")
    assert result.summary["step"] == 2
    assert "jtrain: initialized from exports/x: " in capfd.readouterr().err


def test_same_command_again_resumes_and_changes_nothing(user_run):
    cwd, _ = user_run
    before = read_json(cwd / "runs" / "x" / "summary.json")
    proc = run_python(cwd, "-m", "jtrain.main", "--config=cfg.py", "--workdir=runs/x")
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = read_json(cwd / "runs" / "x" / "summary.json")
    assert after["state_sha256"] == before["state_sha256"] and after["step"] == 6
    assert sorted(os.listdir(cwd / "runs" / "x" / "checkpoints")) == ["3", "6"]


def test_a_typo_in_an_override_is_one_line_and_writes_nothing(user_run):
    cwd, _ = user_run
    proc = run_python(cwd, "-m", "jtrain.main", "--config=cfg.py", "--workdir=runs/typo",
                      "--config.optim.lrr=0.1")
    assert proc.returncode == 2
    line = one_line(proc.stderr)
    assert line == 'jtrain: config error: optim.lrr: unknown key; did you mean "lr"?', line
    assert not (cwd / "runs" / "typo").exists()


def _start(cwd, *args):
    from journey import user_env

    return subprocess.Popen([sys.executable, *args], cwd=cwd, env=user_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _records(path):
    try:
        return [json.loads(ln) for ln in path.read_text().splitlines() if ln.endswith("}")]
    except FileNotFoundError:
        return []


def _kill_at_startup(cwd, delay):
    """SIGTERM from outside `delay` seconds after the command started. The grace period
    is long: on a loaded machine the set-up a start-up stop waits for can take 30 s."""
    proc = _start(cwd, "-m", "jtrain.main", "--config=cfg.py", "--workdir=runs/term",
                  *TERM_ARGS)
    time.sleep(delay)
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, err


def _interrupt_in_eval(cwd):
    """SIGINT (Ctrl-C) once step 3's train record is written: inside the step-3 eval,
    whose 3,000 batches take seconds. (The restart evaluates as the config file says.)"""
    proc = _start(cwd, "-m", "jtrain.main", "--config=cfg.py", "--workdir=runs/int", *EVAL_ARGS)
    metrics = cwd / "runs" / "int" / "metrics.jsonl"
    deadline = time.time() + 300
    while not any(r.get("step") == 3 for r in _records(metrics)) and proc.poll() is None:
        assert time.time() < deadline, "no step-3 record"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, err


TERM_ARGS = ("--config.checkpoint.grace_seconds=600",)
EVAL_ARGS = ("--config.log.every_steps=3", "--config.eval.num_batches=3000")


def test_external_sigterm_at_startup_and_sigint_inside_an_eval_lose_nothing(user_run):
    """os.kill from the test, at a random start-up moment and inside an eval; then the
    same command again finishes with the state of the uninterrupted run (bitwise)."""
    cwd, _ = user_run
    reference = read_json(cwd / "runs" / "x" / "summary.json")["state_sha256"]
    delay = random.Random().uniform(0.5, 6.0)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        term = pool.submit(_kill_at_startup, cwd, delay)
        intr = pool.submit(_interrupt_in_eval, cwd)
        (term_code, term_err), (int_code, int_err) = term.result(), intr.result()
    # Killed before Python imported jtrain (a bare interpreter): like any program, it
    # dies of the signal, having written nothing. From then on: a clean stop, exit 0.
    if term_code != 0:
        assert term_code == -signal.SIGTERM and not (cwd / "runs" / "term").exists(), \
            (delay, term_code, term_err[-3000:])
    assert "Traceback" not in term_err, (delay, term_err[-3000:])
    assert int_code == 0 and "Traceback" not in int_err, int_err[-3000:]
    summary = read_json(cwd / "runs" / "int" / "summary.json")
    assert summary["stopped_by"] == "SIGINT" and summary["step"] == 3, summary
    evals = [r for r in _records(cwd / "runs" / "int" / "metrics.jsonl") if "eval/loss" in r]
    assert evals == [], "the SIGINT landed after the step-3 eval, not inside it"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        again = [pool.submit(run_python, cwd, "-m", "jtrain.main", "--config=cfg.py",
                             f"--workdir=runs/{name}", *extra)
                 for name, extra in (("term", TERM_ARGS), ("int", ()))]  # eval.*, log.*: resumable
        again = [f.result() for f in again]
    for name, proc in zip(("term", "int"), again, strict=True):
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        final = read_json(cwd / "runs" / name / "summary.json")
        assert final["step"] == 6 and final["state_sha256"] == reference, (name, delay, final)
