"""`--verify_resume` with a workdir in a bucket, as its user runs it: the two commands of
docs/guide/object-storage.md's "Check that resume is exact, on the bucket" from a temp
cwd with the user's own Linen model and data, against a real S3-protocol server (moto's,
on 127.0.0.1). The reference and the killed run go to the prefixes reference/ and
interrupted/ of the workdir; the verdict is PASS with every kill landed, and the negative
control (data position not restored on restarts) is a FAIL. Nothing is left in TMPDIR
or the cwd but the user's files."""

import json
import subprocess
import uuid
from pathlib import Path

from journey import s3_server, user_dir, user_env
from test_doc_examples import _argv, bash_lines, blocks
from test_forensics_journey import CONFIG  # the user's Linen model and data, 8 steps

PAGE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "object-storage.md"
EVALS = CONFIG.replace("c.eval.every_steps = 0", "c.eval.every_steps = 4")  # eval kills


def page_lines(bucket: str) -> list[list[str]]:
    """The page's block tested here, its bucket name replaced by this test's."""
    body = [b for m, lang, b in blocks(PAGE) if lang == "bash"
            and m == f"tested: tests/journeys/{Path(__file__).name}"]
    assert len(body) == 1
    return [[a.replace("my-bucket", bucket) for a in argv] for argv in bash_lines(body[0])]


def _verdict(argv, cwd, env) -> tuple[int, str]:
    proc = subprocess.run(_argv(argv), cwd=cwd, capture_output=True, text=True,
                          timeout=600, env=user_env(**env))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("jtrain: verify_resume:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, \
        proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.returncode, lines[0]


def test_verify_resume_passes_on_a_bucket_and_its_negative_control_fails(tmp_path):
    import fsspec

    assert EVALS != CONFIG
    bucket = f"my-bucket-{uuid.uuid4().hex[:8]}"
    user_dir(tmp_path, ["linen_classifier", "mydata"], {"cfg.py": EVALS})
    (tmp_path / "tmp").mkdir()
    verify, control = page_lines(bucket)
    with s3_server(bucket) as (_, env):
        env = {**env, "TMPDIR": str(tmp_path / "tmp")}
        code, line = _verdict(verify, tmp_path, env)
        assert code == 0 and line.startswith(
            "jtrain: verify_resume: PASS: bitwise identical after 2/2 kills landed"), line
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        summaries = [json.loads(fs.cat(f"{bucket}/checks/v/{name}/summary.json"))
                     for name in ("reference", "interrupted")]
        assert summaries[0]["step"] == summaries[1]["step"] == 8
        assert summaries[0]["state_sha256"] == summaries[1]["state_sha256"]
        assert f"state_sha256 {summaries[1]['state_sha256'][:12]} vs " \
               f"{summaries[0]['state_sha256'][:12]}" in line
        for name in ("reference", "interrupted"):  # committed steps, logs beside them
            assert fs.exists(f"{bucket}/checks/v/{name}/checkpoints/8/jtrain_committed.json")
            assert fs.exists(f"{bucket}/checks/v/{name}.log")

        code, line = _verdict(control, tmp_path, env)
        assert code == 1 and line.startswith(
            "jtrain: verify_resume: FAIL: resumed run differs from the uninterrupted one"), \
            line
        assert line.endswith("(negative control: data position not restored)")
    assert sorted(p.name for p in tmp_path.iterdir()) == \
        ["cfg.py", "linen_classifier.py", "mydata.py", "tmp"]
    assert not list((tmp_path / "tmp").glob("jtrain-*"))  # staging copies, cache: removed
