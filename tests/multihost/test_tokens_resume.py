"""Exact resume on token shards (data.name=tokens), from the command line: a run
SIGKILLed at its 5th step, in the middle of a shard, and rerun ends with the state hash
of the same run trained straight through, on 8 fake devices. As 2 processes over
loopback, the launcher journey (tests/multihost/test_launch_runs.py) trains on token
shards: SIGKILLed at its 5th step by launch/local.sh, then stopped and resumed through
slurm.sh and the k8s Job, it ends with the uninterrupted run's state hash. On 1 device
the tokens journey's --verify_resume kills and resumes a token-shard run
(tests/journeys/test_tokens_journey.py)."""

from __future__ import annotations

import pytest

from launching import TINY, finish, start, summary, token_shards, user_dir

pytestmark = pytest.mark.slow

STEPS = 12
RUN = [*TINY, "--config.data.name=tokens", "--config.data.path=shards",
       f"--config.total_steps={STEPS}"]
EIGHT = "--xla_force_host_platform_device_count=8"


def killed_then_resumed(cwd, launch, workdir: str, **env) -> dict:
    rc, out, err = finish(start([*launch, *RUN, "--config.checkpoint.every_steps=2",
                                 f"--workdir={workdir}"], cwd, JTRAIN_FAULT="step:5", **env))
    assert rc in (-9, 137), (rc, err[-2000:])
    assert not (cwd / workdir / "summary.json").exists()
    rc, out, err = finish(start([*launch, *RUN, "--config.checkpoint.every_steps=2",
                                 f"--workdir={workdir}"], cwd, **env))
    assert rc == 0, err[-3000:] + out[-1000:]
    assert "resum" in (cwd / workdir / "train.log").read_text().lower()
    return summary(cwd / workdir)


def straight(cwd, launch, workdir: str, **env) -> dict:
    rc, out, err = finish(start([*launch, *RUN, "--config.checkpoint.every_steps=0",
                                 f"--workdir={workdir}"], cwd, **env))
    assert rc == 0, err[-3000:] + out[-1000:]
    return summary(cwd / workdir)


def test_a_kill_mid_shard_resumes_to_the_uninterrupted_state(tmp_path):
    cwd = user_dir(tmp_path)
    assert token_shards(cwd) >= 3
    launch, env = ["python", "-m", "jtrain.main"], {"XLA_FLAGS": EIGHT}
    ref = straight(cwd, launch, "ref", **env)
    got = killed_then_resumed(cwd, launch, "run", **env)
    assert got["step"] == ref["step"] == STEPS
    assert got["state_sha256"] == ref["state_sha256"]
    assert "jtrain: 8 cpu device(s)" in (cwd / "run" / "train.log").read_text()
