"""The user's journey of docs/guide/checkpoints.md's two tiers: the guide's restart
loop, from a temp cwd with a user's model, is killed after a local save (the restart
takes the newer local step), with the local tier lost (the restart takes the
workdir's step) and in the middle of a local save (the torn step is removed and the
workdir's newer step taken); it ends with the state hash and per-step hashes of a run
never killed, and its goodput ledger counts the steps computed again."""

import json
import re
from pathlib import Path

import pytest

from journey import nnx_mlp_config, run_python, marked_block, user_dir
from jtrain.control import faults
from jtrain.observe import goodput, layout

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "guide" / "checkpoints.md"

CONFIG = nnx_mlp_config(total_steps=20, eval_every=10, log_every=5, checkpoint_every=5)


@pytest.fixture(scope="module")
def journey(tmp_path_factory):
    """(cwd, the restart loop's process, the reference's process)."""
    cwd = user_dir(tmp_path_factory.mktemp("tiers"), ["nnx_mlp"],
                   {"cfg.py": CONFIG, "restart.py": marked_block(
                       GUIDE, "tests/checkpoint/test_tiers_journey.py")})
    loop = run_python(cwd, "restart.py", timeout=600)
    reference = run_python(cwd, "-m", "jtrain.main", "--config=cfg.py", "--workdir=runs/ref")
    return cwd, loop, reference


def test_each_restart_takes_the_newest_intact_step_of_either_tier(journey):
    cwd, loop, reference = journey
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert loop.returncode == 0, loop.stderr[-3000:]
    said = [ln for ln in loop.stdout.splitlines() if ln.startswith("attempt ")]
    assert said == ["attempt 1: exit -9", "attempt 2: exit -9", "attempt 3: exit -9",
                    "attempt 4: exit 0"]
    starts = re.findall(r"workdir \S+; (resumed from step \d+(?: \(local tier\))?|fresh "
                        r"start)", loop.stdout + loop.stderr)
    assert starts == ["fresh start", "resumed from step 8 (local tier)",
                      "resumed from step 10", "resumed from step 15"], starts
    local = cwd / "local_disk"
    assert re.search(r"fault: deleted the local checkpoint tier \S*local_disk/\w+",
                     loop.stdout + loop.stderr)
    assert re.search(r"warning: \S*local_disk/\w+/16\.orbax-checkpoint-tmp\S*: an unfinished "
                     r"save \(killed while writing\); removed", loop.stderr)
    run, ref = cwd / "runs" / "tiers", cwd / "runs" / "ref"
    (folder,) = local.iterdir()
    assert folder.name == json.loads((run / "local_tier.json").read_text())["id"]
    # the newest local step, and which workdir owns the folder
    assert sorted(p.name for p in folder.iterdir()) == ["18", "tier_owner.json"]
    owner = json.loads((folder / "tier_owner.json").read_text())
    assert owner["identity"] == [run.stat().st_dev, run.stat().st_ino]
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == [10, 15, 20]
    assert all(layout.listed(p.name) for p in run.iterdir())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["state_sha256"] == json.loads((ref / "summary.json").read_text())[
        "state_sha256"]
    assert (run / "hashes.jsonl").read_text() == (ref / "hashes.jsonl").read_text()
    fired = [json.loads(x)["fault"] for x in (run / faults.FILE).read_text().splitlines()]
    assert fired == ["kill@9", "lost_local@13", "torn_ckpt@16"]
    records = goodput.read(str(run))
    assert [(r["first_step"], r["step"], r["done"]) for r in records] == [
        (0, 9, False), (8, 13, False), (10, 16, False), (15, 20, True)]
    assert summary["goodput"]["steps"] == {"computed": 25, "recomputed": 5}
