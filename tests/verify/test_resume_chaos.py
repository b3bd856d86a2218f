"""The chaos test: SIGKILL a run mid-step, mid-eval, mid-save and at a random moment,
restart it each time, and require the final state to be bitwise identical to an
uninterrupted run (jtrain.verify.resume), on 8 fake devices with a torch map-style dataset,
2 grain workers, dropout and bfloat16 compute. Then the negative control: with the data
position not restored on restart, the verifier must report a mismatch, every time (its
kill lands after the first save and before the last one by construction)."""

import os
import random
import sys

import pytest

from jtrain.verify import resume as verify


SCRIPT = '''
import sys
import torch
import jtrain


class Halves(torch.utils.data.Dataset):
    """Is the first half of x bigger than the second? Items are (tensor, tensor)."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 16, generator=g)
        self.y = (self.x[:, :8].sum(1) > self.x[:, 8:].sum(1)).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


config = {
    "seed": 3, "total_steps": 100,
    "model": {"name": "mlp", "hidden": (64, 64), "num_outputs": 2, "dropout": 0.2,
              "dtype": "bfloat16"},
    "data": {"batch_size": 32, "num_workers": 2, "device_prefetch": 2},  # the threaded path
    "optim": {"lr": 3e-3, "warmup_steps": 5, "decay_steps": 100},
    "eval": {"every_steps": 25, "num_batches": 2},
    "checkpoint": {"every_steps": 20},
    "log": {"every_steps": 10, "writers": ("jsonl",)},
}
if __name__ == "__main__":  # grain's worker processes import this file too
    jtrain.train(config, sys.argv[1], train_data=Halves(2048, 0), eval_data=Halves(128, 1))
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("chaos")
    script = root / "run.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, JAX_PLATFORMS="cpu",  # jtrain as installed
               XLA_FLAGS="--xla_force_host_platform_device_count=8",
               # Restarts reuse the reference's compiled programs (same executables).
               JAX_COMPILATION_CACHE_DIR=str(root / "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")

    def command(workdir):
        return [sys.executable, str(script), workdir]

    return root, command, env


def test_killed_and_restarted_run_is_bitwise_identical(setup):
    root, command, env = setup
    rng = random.Random(1234)
    # An order in which every fault point is still ahead of the restarted run, so each
    # lands whatever the machine's speed: mid-step at 30 (resumes from 20), in the 2nd
    # eval of the restart (step 50, resumes from 40), in its 2nd save (step 80, resumes
    # from 60); then an external SIGKILL at a random moment of the last restart, which
    # is bounded by a step kill before the final step, so it always lands.
    plan = [("step", rng.randint(25, 35)), ("eval", 2), ("save", 2),
            ("time", round(rng.uniform(1.0, 5.0), 2))]
    verdict = verify.verify_resume(command, str(root / "positive"), env=env, plan=plan,
                                   timeout=240)
    assert verdict.ok, verdict.line
    assert verdict.line.startswith("PASS") and len(verdict.resumed_from) >= 2, verdict.line
    assert all(k.split("(")[0] == k for k in verdict.kills[:3]), verdict.kills  # all killed
    assert verdict.landed == verdict.requested == 4 and "4/4 kills landed" in verdict.line
    assert all(0 < s < 100 for s in verdict.resumed_from), verdict.resumed_from


def test_negative_control_without_data_position_fails(setup):
    root, command, env = setup
    reference = root / "positive" / "reference"
    # Reuses the positive test's reference when it ran (else makes its own).
    reference = str(reference) if (reference / "summary.json").exists() else None
    # The kill comes in the run's 2nd save (step 25, a save_on_best save, or 40), which
    # begins only once the save of step 20 finished: the restart resumes from 20 or the
    # 2nd save's step, never from 0 or 100.
    verdict = verify.verify_resume(command, str(root / "negative"), env=env,
                                   negative_control=True, reference=reference,
                                   plan=[("save", 2)], timeout=240)
    assert not verdict.ok and verdict.line.startswith("FAIL: resumed run differs"), verdict.line
    assert verdict.kills == ["save:2"] and verdict.resumed_from in ([20], [25], [40]), verdict.line
