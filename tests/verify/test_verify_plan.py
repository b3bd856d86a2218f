"""--verify_resume's logic without training: where each kill is placed (`place_kill`),
the verdict from run histories (`judge`), and the whole verifier driving a stand-in
training script (plain Python, no JAX) that honours JTRAIN_FAULT and
JTRAIN_SKIP_DATA_RESTORE, writes step directories with a manifest and summary.json."""

import json
import os
import signal
import sys

from jtrain.verify import resume as verify
from jtrain.verify.resume import Attempt, Timeline

KILLED = -signal.SIGKILL

FAKE = '''
import hashlib, json, os, signal, sys, time
workdir, total, every, eval_every, fault_free = (sys.argv[1], int(sys.argv[2]),
                                                 int(sys.argv[3]), int(sys.argv[4]),
                                                 sys.argv[5] == "1")
ckpts = os.path.join(workdir, "checkpoints")
os.makedirs(ckpts, exist_ok=True)
spec = None if fault_free else os.environ.get("JTRAIN_FAULT")
kind, n = (spec.split(":")[0], int(spec.split(":")[1])) if spec else (None, 0)
counts = {}

def fault(k):
    counts[k] = counts.get(k, 0) + 1
    if k == kind and counts[k] == n:
        os.kill(os.getpid(), signal.SIGKILL)

done = sorted(int(d) for d in os.listdir(ckpts)
              if d.isdigit() and os.path.exists(os.path.join(ckpts, d, "jtrain_manifest.json")))
step, state, pos = 0, "init", 0
if done:
    with open(os.path.join(ckpts, str(done[-1]), "state.json")) as f:
        saved = json.load(f)
    step, state = saved["step"], saved["state"]
    pos = 0 if os.environ.get("JTRAIN_SKIP_DATA_RESTORE") else saved["pos"]
while step < total:
    step += 1
    state = hashlib.sha256(f"{state}/{pos}".encode()).hexdigest()
    pos += 1
    time.sleep(0.004)
    if step % eval_every == 0 or step == total:
        fault("eval")
    fault("step")
    if step % every == 0 or step == total:
        tmp = os.path.join(ckpts, f"{step}.orbax-checkpoint-tmp-1")
        os.makedirs(tmp, exist_ok=True)  # a killed save's leftover is written over
        fault("save")
        with open(os.path.join(tmp, "state.json"), "w") as f:
            json.dump({"step": step, "state": state, "pos": pos}, f)
        open(os.path.join(tmp, "jtrain_manifest.json"), "w").close()
        os.rename(tmp, os.path.join(ckpts, str(step)))
with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump({"step": step, "state_sha256": state}, f)
'''


def _command(tmp_path, total=20, every=5, eval_every=10, fault_free=False):
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE)
    return lambda workdir: [sys.executable, str(script), workdir, str(total), str(every),
                            str(eval_every), "1" if fault_free else "0"]


def _verify(tmp_path, plan, **kwargs):
    command = _command(tmp_path, **kwargs.pop("script", {}))
    return verify.verify_resume(command, str(tmp_path / "v"), plan=plan, timeout=60,
                                env=dict(os.environ), **kwargs)


# place_kill: every kill lands strictly before the final save

TL = Timeline(final_step=100, save_steps=[20, 40, 60, 80, 100], last_save_s=10.0)


def test_step_kill_is_bounded_before_the_final_step():
    assert verify.place_kill("step", 30, None, TL).fault == "step:30"
    placed = verify.place_kill("step", 30, 80, TL)  # resumes at 80: 19 steps before 100
    assert placed.fault == "step:19" and "was step:30" in placed.label
    assert verify.place_kill("step", 30, 80, TL, later=2).fault == "step:6"  # a third of 19
    assert verify.place_kill("step", 15, 80, TL, later=2).fault == "step:15"
    assert verify.place_kill("step", 5, 99, TL) is None  # nothing left before the end
    assert verify.place_kill("time", 1.5, 100, TL) is None


def test_save_kill_is_never_the_final_save():
    assert verify.place_kill("save", 2, 20, TL).fault == "save:2"  # step 60
    assert verify.place_kill("save", 3, 60, TL).fault == "save:1"  # only 80 is left
    placed = verify.place_kill("save", 1, 80, TL)  # the next save is the final one
    assert placed.fault.startswith("step:") and "was save:1" in placed.label
    assert int(placed.fault.split(":")[1]) < 20


def test_time_kill_has_a_step_backstop_and_eval_a_save_backstop():
    placed = verify.place_kill("time", 2.5, 40, TL)
    assert placed.after_s == 2.5 and placed.fault == "step:59"
    placed = verify.place_kill("eval", 2, 40, TL)
    assert placed.fault == "eval:2" and placed.when_saving == 80


def test_kill_plan_has_the_requested_kinds():
    import random
    plan = verify.kill_plan(5, random.Random(0), steps_hint=100, ref_seconds=10.0)
    assert sorted(k for k, _ in plan) == ["eval", "save", "step", "time", "time"]
    assert all(3.0 <= v <= 9.0 for k, v in plan if k == "time")


# judge: PASS needs every kill landed and a resume strictly inside the run

REF = {"step": 100, "state_sha256": "a" * 64}


def test_judge_pass_and_its_counts():
    attempts = [Attempt("step:30", None, KILLED), Attempt("save:2", 20, KILLED),
                Attempt(None, 60, 0)]
    verdict = verify.judge(REF, dict(REF), attempts, requested=2)
    assert verdict.ok and verdict.line.startswith("PASS"), verdict.line
    assert "2/2 kills landed" in verdict.line and verdict.resumed_from == [20, 60]


def test_judge_a_kill_that_did_not_land_is_a_fail():
    # A reported case: --verify_kills=2 with one kill landed printed PASS.
    attempts = [Attempt("time:3.1", None, KILLED), Attempt("step:16", 20, 0)]
    verdict = verify.judge(REF, dict(REF), attempts, requested=2)
    assert not verdict.ok and verdict.line.startswith("FAIL: only 1/2 kills landed"), \
        verdict.line
    assert verdict.kills == ["time:3.1", "step:16 (exit 0, not killed)"]


def test_judge_a_restart_from_the_final_checkpoint_is_no_resume():
    # A kill after the final save: the restart restores step 100, trains nothing.
    attempts = [Attempt("time:9.0", None, KILLED), Attempt(None, 100, 0)]
    verdict = verify.judge(REF, dict(REF), attempts, requested=1)
    assert not verdict.ok and verdict.line.startswith("INCONCLUSIVE"), verdict.line
    attempts = [Attempt("time:0.1", None, KILLED), Attempt(None, None, 0)]
    assert verify.judge(REF, dict(REF), attempts, 1).line.startswith("INCONCLUSIVE")


def test_judge_mismatch_and_failed_runs():
    attempts = [Attempt("save:2", None, KILLED), Attempt(None, 20, 0)]
    other = {"step": 100, "state_sha256": "b" * 64}
    assert verify.judge(REF, other, attempts, 1).line.startswith("FAIL: resumed run differs")
    attempts = [Attempt("save:2", None, KILLED), Attempt(None, 20, 3)]
    assert verify.judge(REF, None, attempts, 1).line.startswith("FAIL: a restarted run "
                                                                "exited 3")


# The verifier end to end, on the stand-in script (about 2 s in all)

def test_every_kind_lands_and_the_verdict_passes(tmp_path):
    # The step kill asks for more steps than the run has: it is moved before the end.
    plan = [("step", 50), ("eval", 1), ("save", 3), ("time", 0.02)]
    verdict = _verify(tmp_path, plan)
    assert verdict.ok, verdict.line
    assert "4/4 kills landed" in verdict.line and verdict.landed == 4, verdict.line
    assert all(0 < s < 20 for s in verdict.resumed_from) and verdict.resumed_from
    assert verdict.kills[:3] == ["step:4 [was step:50]", "eval:1", "save:1 [was save:3]"]
    assert verdict.kills[3] in ("time:0.02", "step:4 [backstop of time:0.02]"), verdict.kills


def test_negative_control_always_fails(tmp_path):
    for attempt in range(3):  # the same outcome every time
        verdict = _verify(tmp_path / str(attempt), [("save", 2)], negative_control=True)
        assert verdict.line.startswith("FAIL: resumed run differs"), verdict.line
        assert verdict.resumed_from == [5] or verdict.resumed_from == [10], verdict.line


def test_a_run_that_cannot_be_killed_fails(tmp_path):
    verdict = _verify(tmp_path, [("step", 3)], script={"fault_free": True})
    assert verdict.line.startswith("FAIL: only 0/1 kills landed"), verdict.line
    assert verdict.kills == ["step:3 (exit 0, not killed)"]


def test_a_kill_before_the_first_save_is_inconclusive(tmp_path):
    verdict = _verify(tmp_path, [("step", 2)])
    assert verdict.line.startswith("INCONCLUSIVE") and verdict.landed == 1, verdict.line


def test_reference_timeline_is_recorded(tmp_path):
    command = _command(tmp_path)
    (tmp_path / "ref").mkdir()
    code, seconds, seen = verify._reference_run(command, str(tmp_path / "ref"),
                                                dict(os.environ), str(tmp_path / "log"), 60)
    assert code == 0 and set(seen) == {5, 10, 15, 20}, seen
    assert sorted(seen.values()) == [seen[5], seen[10], seen[15], seen[20]] and seen[20] <= seconds
    assert json.loads((tmp_path / "ref" / "summary.json").read_text())["step"] == 20


def test_eval_backstop_ignores_a_killed_saves_leftover(tmp_path):
    ckpts = tmp_path / "checkpoints"
    (ckpts / f"15{verify.integrity.TMP_MARK}").mkdir(parents=True)
    watch = verify._new_save_watch(str(tmp_path), 15)
    assert not watch(0.0)
    (ckpts / "15").mkdir()  # the same save, written again and finished
    assert watch(0.1)
