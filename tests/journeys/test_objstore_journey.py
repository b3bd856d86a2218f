"""A run on object storage as its user meets it, against a real S3-protocol server
(moto's server mode on 127.0.0.1, started here; the endpoint and dummy credentials in the
environment): the CLI from a temp cwd with the user's own Linen model and data module
trains to s3://, is SIGKILLed after step 5, and the commands of
docs/guide/object-storage.md run as written: the rerun resumes from the bucket and ends
with the state_sha256 of the same run trained straight through on a local disk (that
reference run is trained in this process);
evaluate writes its report into the bucket, export uploads to the bucket, a new run
starts from that export; `jtrain diff` (bucket vs local) says identical and `jtrain
replay` reproduces step 5 from the bucket. An unreachable endpoint is one line, exit 2
(the train command called in this process)."""

import json
import uuid
from pathlib import Path

from journey import free_address, own_modules, run_python, s3_server, user_dir, user_env
from test_doc_examples import _argv, bash_lines, blocks
from test_forensics_journey import CONFIG  # the user's Linen model and data, 8 steps

PAGE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "object-storage.md"


def page_lines(bucket: str) -> list[list[str]]:
    """The page's tested block, its bucket name replaced by this test's."""
    body = [b for m, lang, b in blocks(PAGE) if lang == "bash"
            and m == "tested: tests/journeys/test_objstore_journey.py"]
    assert len(body) == 1
    return [[a.replace("my-bucket", bucket) for a in argv] for argv in bash_lines(body[0])]


def test_train_kill_resume_evaluate_export_from_a_bucket(tmp_path, monkeypatch, capsys):
    import subprocess

    import fsspec

    import jtrain
    from jtrain import cli

    bucket = f"my-bucket-{uuid.uuid4().hex[:8]}"
    user_dir(tmp_path, ["linen_classifier", "mydata"], {"cfg.py": CONFIG})
    train = ["-m", "jtrain.main", "--config=cfg.py"]
    with s3_server(bucket) as (_, env):
        # a killed run leaves its staging copy in TMPDIR: this test's, not the machine's
        (tmp_path / "tmp").mkdir()
        env = {**env, "TMPDIR": str(tmp_path / "tmp")}
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        # the same run trained straight through on a local disk (in this process: the
        # reference, not the journey)
        monkeypatch.syspath_prepend(str(tmp_path))
        ns: dict = {}
        exec(CONFIG, ns)
        with own_modules("linen_classifier", "mydata"):
            jtrain.train(ns["get_config"](), str(tmp_path / "runs/ref"))
        run = f"s3://{bucket}/runs/exp1"
        killed = run_python(tmp_path, *train, f"--workdir={run}", JTRAIN_FAULT="step:5",
                            **env)
        assert killed.returncode == -9, killed.stderr[-2000:]
        assert fs.exists(f"{bucket}/runs/exp1/checkpoints/2/jtrain_committed.json")

        outs = []
        for argv in page_lines(bucket):  # the page's commands, as a user types them
            proc = subprocess.run(_argv(argv), cwd=tmp_path, capture_output=True, text=True,
                                  timeout=300, env=user_env(**env))
            assert proc.returncode == 0 and "Traceback" not in proc.stderr, \
                (argv, proc.stderr[-3000:])
            outs.append(proc)
        resumed, evaluated, exported, started = outs
        assert f"workdir {run}; resumed from step " in resumed.stdout + resumed.stderr
        summary = json.loads(fs.cat(f"{bucket}/runs/exp1/summary.json"))
        expected = json.loads((tmp_path / "runs/ref/summary.json").read_text())
        assert summary["step"] == 8 and summary["state_sha256"] == expected["state_sha256"]
        # the records of both sessions, the killed one's past its checkpoint dropped
        assert fs.cat(f"{bucket}/runs/exp1/hashes.jsonl").decode() == \
            (tmp_path / "runs/ref/hashes.jsonl").read_text()
        assert json.loads(resumed.stdout.splitlines()[-1])["workdir"] == run
        assert f"wrote eval_8.json in {run}" in evaluated.stdout
        assert json.loads(fs.cat(f"{bucket}/runs/exp1/eval_8.json"))["step"] == 8
        assert f"to s3://{bucket}/exports/exp1/params.safetensors" in exported.stdout
        assert fs.exists(f"{bucket}/exports/exp1/params.safetensors")
        assert f"initialized from s3://{bucket}/exports/exp1 (step 8" in \
            started.stdout + started.stderr
        assert fs.exists(f"{bucket}/runs/exp2/checkpoints/2/jtrain_committed.json")
        assert not list((tmp_path).glob("s3*"))  # nothing written to a local "s3:" folder

        diff = run_python(tmp_path, "-m", "jtrain.diff", run, "runs/ref", **env)
        assert diff.returncode == 0, diff.stderr[-2000:]
        assert json.loads(diff.stdout)["identical"] is True
        assert json.loads(diff.stdout)["run_a"] == run
        replay = run_python(tmp_path, "-m", "jtrain.replay", run, "--step=5", **env)
        assert replay.returncode == 0, replay.stderr[-2000:]
        assert json.loads(replay.stdout)["reproduced"] is True
        # every command removed its staging copy; the killed run could not
        assert len(list((tmp_path / "tmp").glob("jtrain-run-*"))) == 1

        # the train command in this process (the journey above starts the same code)
        nowhere = f"http://{free_address()}"  # a loopback port nothing listens on
        capsys.readouterr()
        with monkeypatch.context() as m, own_modules("linen_classifier", "mydata"):
            m.chdir(tmp_path)
            m.setenv("AWS_ENDPOINT_URL", nowhere)
            code = cli.run_command("train", ["--config=cfg.py",
                                             f"--workdir=s3://{bucket}/runs/x"])
        assert code == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"jtrain: workdir error: s3://{bucket}/runs/x: cannot reach the object store "
            f"(Could not connect to the endpoint URL: \"{nowhere}/{bucket}?list-type=2&"
            "prefix=&delimiter=%2F&encoding-type=url\"); check the network and "
            "AWS_ENDPOINT_URL"]
