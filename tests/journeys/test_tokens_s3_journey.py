"""Token shards in a bucket as their user meets them, against a real S3-protocol server
(moto's server mode, tests/journey.py): `jtrain tokenize --out=s3://...`, a run with
data.path=s3://... from a temp cwd fetches the shards once into its workdir (nothing
written elsewhere; with a workdir in the bucket too, they are not uploaded), a rerun with
more steps and `jtrain evaluate` read the cached copies with the bucket's shard gone,
and a shard changed in the bucket is one line naming it, exit 2."""

import json
import os
import uuid

from journey import run_python, s3_server

TRAIN = ["-m", "jtrain.main", "--config=base:debug", "--config.data.name=tokens",
         "--config.data.seq_len=16", "--config.model.max_len=16",
         "--config.data.batch_size=4", "--config.model.d_model=16",
         "--config.model.num_layers=1", "--config.eval.every_steps=2",
         "--config.checkpoint.every_steps=2", "--config.checkpoint.async_save=False"]


def files_under(top) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), top) for d, _, fs in os.walk(top) for f in fs}


def test_shards_in_a_bucket_are_fetched_once_into_the_workdir_and_checked(tmp_path):
    import fsspec

    bucket = f"corpus-{uuid.uuid4().hex[:8]}"
    (tmp_path / "docs.jsonl").write_text("".join(
        json.dumps({"text": f"document {i}: the shards live in a bucket"}) + "\n"
        for i in range(60)))
    with s3_server(bucket) as (_, env):
        uri = f"s3://{bucket}/shards"
        made = run_python(tmp_path, "-m", "jtrain", "tokenize", "--input=docs.jsonl",
                          f"--out={uri}", "--shard_tokens=1000", **env)
        assert made.returncode == 0, made.stderr[-2000:]
        summary = json.loads(made.stdout.strip().splitlines()[-1])
        assert summary["shards"] >= 2 and summary["out"] == uri
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        assert fs.exists(f"{bucket}/shards/index.json")
        before = files_under(tmp_path)

        proc = run_python(tmp_path, *TRAIN, "--workdir=runs/lm", f"--config.data.path={uri}",
                          "--config.total_steps=4", **env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        cached = tmp_path / "runs" / "lm" / "token_shards" / summary["fingerprint"]
        assert sorted(os.listdir(cached)) == [f"shard-{i:05d}.bin"
                                              for i in range(summary["shards"])]
        assert (cached / "shard-00000.bin").read_bytes() == \
            fs.cat_file(f"{bucket}/shards/shard-00000.bin")
        # nothing written outside the workdir (the bucket's shards are not copied beside it)
        assert {f for f in files_under(tmp_path) - before
                if not f.startswith("runs/lm/")} == set()

        # a workdir in the bucket too: the fetched copies stay in its staging folder
        (tmp_path / "tmp").mkdir()
        proc = run_python(tmp_path, *TRAIN, f"--workdir=s3://{bucket}/runs/lm",
                          f"--config.data.path={uri}", "--config.total_steps=2",
                          TMPDIR=str(tmp_path / "tmp"), **env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert fs.exists(f"{bucket}/runs/lm/config.json")
        assert not fs.glob(f"{bucket}/runs/lm/token_shards*")

        # a later start reads the cached copies: the bucket's shard may even be gone
        fs.rm(f"{bucket}/shards/shard-00001.bin")
        proc = run_python(tmp_path, *TRAIN, "--workdir=runs/lm", f"--config.data.path={uri}",
                          "--config.total_steps=6",
                          "--config.checkpoint.allow_changes=total_steps", **env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "resum" in (tmp_path / "runs" / "lm" / "train.log").read_text().lower()
        # so does `jtrain evaluate` of the run (its eval split, through the run's copies)
        proc = run_python(tmp_path, "-m", "jtrain", "evaluate", "--workdir=runs/lm", **env)
        assert proc.returncode == 0, proc.stderr[-3000:]

        # a shard changed in the bucket after tokenize: one line naming it, before any step
        raw = bytearray(fs.cat_file(f"{bucket}/shards/shard-00000.bin"))
        raw[5] ^= 1
        fs.pipe_file(f"{bucket}/shards/shard-00000.bin", bytes(raw))
        proc = run_python(tmp_path, *TRAIN, "--workdir=runs/fresh",
                          f"--config.data.path={uri}", "--config.total_steps=2", **env)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert proc.stderr.strip().splitlines()[-1] == (
            f"jtrain: data error: {uri}/shard-00000.bin: its sha256 differs from "
            "index.json's (the shard changed after jtrain tokenize)")
        # nothing of it kept: neither the shard nor a partial download
        assert not [p for p in (tmp_path / "runs" / "fresh").rglob("*") if p.is_file()
                    and "token_shards" in p.parts]
