"""The end of a run: summary.json and the one final line (done, stopped by a signal,
stopped early, already finished, too many updates skipped), the record of a non-finite
halt, and the best step of the monitored metric. Called by engine/run.py's page after
jtrain.engine.loop.run_loop returns; a population adds its block (engine.population)."""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from jtrain import errors
from jtrain import state as state_lib
from jtrain.control import ledger as ledger_lib
from jtrain.data import mixture as mixture_lib
from jtrain.engine import evaluation as evaluator
from jtrain.engine import population as population_lib
from jtrain.engine import sample as sample_lib
from jtrain.observe import goodput as goodput_lib, layout
from jtrain.observe import jsonl, runfiles
from jtrain.errors import WorkdirError

# summary.json's stopped_by when the run ended with more than nonfinite.max_skipped_share
# of its updates skipped: not done (exit 4), its checkpoints kept.
SKIPPED_SHARE = "max_skipped_share"


def stored_summary(workdir: str, state) -> dict | None:
    """summary.json when it is the record of exactly this state (a finished run)."""
    try:
        stored = runfiles.read_object(os.path.join(workdir, "summary.json"))
    except (FileNotFoundError, WorkdirError):
        return None  # not the record of this state: the summary is written again
    if stored.get("step") != int(jax.device_get(state.step)):
        return None
    if stored.get("stopped_by") == SKIPPED_SHARE:  # not done: judged again, with this config
        return None
    return stored if stored.get("state_sha256") == state_lib.state_sha256(state) else None


def summarize(cfg, run, state, session) -> dict:
    """summary.json (process 0) and the final line; `run` is a jtrain.engine.loop.Run, `session`
    the loop's _Session."""
    step = int(jax.device_get(state.step))
    if session.stored is not None:  # finished before: say so, return what it recorded
        run.out.progress.final(f"jtrain: already finished at step {step} (summary.json); "
                               "nothing to do")
        run.goodput.discard()  # this session did nothing: the ledger stays the run's
        session.train_history = [
            {k: v for k, v in r.items() if k == "step" or k.startswith("train/")}
            for r in jsonl.read_records(os.path.join(run.workdir, "metrics.jsonl"))
            if any(k.startswith("train/") for k in r)]
        return session.stored
    last_eval = session.history[-1] if session.history else {}
    # Only an eval of the final step is the run's result; an older one (a stop between
    # evals) is kept apart, with its step, never presented as final.
    final_eval = last_eval if last_eval.get("step") == step else {}
    summary = {
        "step": step,
        "state_sha256": state_lib.state_sha256(state),
        # a population: the most any member skipped (each member's: `population`), and
        # each member's lr factor
        "skipped_steps": int(np.max(jax.device_get(state.skipped_steps))),
        "lr_factor": np.asarray(jax.device_get(state.lr_factor)).tolist(),
        "resumed_from": run.resumed_from,
        "stopped_by": session.stopped_by,  # SIGTERM, SIGINT, early_stop, on_eval; None
        "stop_reason": session.stop_reason,
        "rollbacks": run.decisions.spike.rollbacks,  # [[spike step, rolled back to]]
        "warnings": run.decisions.divergence.warnings,  # the divergence warning, if any
        **_best(cfg, run),
        **{k: v for k, v in final_eval.items() if k != "step"},
        **({"last_eval": last_eval} if last_eval and not final_eval else {}),
        **run.out.perf.summary(),
        **run.startup.recorder.summary(),
    }
    if run.build.population is not None:  # its block and population.png
        summary.update(population_lib.report(run.build.population, cfg, run, state,
                                             session, final_eval))
    # What the set-up decided beyond config.json, as run.json records it.
    summary["decided"] = run.record.get("decided", {})
    # The precision configured and what the traced model computes in (matmul dtypes).
    summary["precision"] = run.build.policy.record()
    baseline = run.data.info.get("unigram_baseline")
    if baseline is not None:
        summary["unigram_baseline"] = baseline
        summary["data_fingerprint"] = run.data.info["fingerprint"]
        if "eval/loss" in summary:
            run.out.progress.message(f"jtrain: final eval loss {summary['eval/loss']:.4f} "
                                     f"nats/byte vs unigram baseline {baseline:.4f}")
    if session.stopped_by not in ("SIGINT", "SIGTERM") and jax.process_index() == 0:
        for line in sample_lib.end_of_run(cfg, run, state):  # the final params, read only
            run.out.progress.message(line)
    mix = run.data.mixture_report(run.train_iter.get_state())
    if mix is not None:  # each component's draws and epochs, also on the console
        summary["data"] = {"mixture": mix}
        run.out.progress.message(mixture_lib.report_line(
            mix, int(run.train_iter.get_state()["position"])))
    summary["goodput"] = run.goodput.finish()  # every session's seconds, this one's ended
    run.out.progress.message(goodput_lib.line(summary["goodput"]))
    summary["message"] = _final_line(summary, session)
    summary["exit_code"] = 0
    failed = None if session.stopped_by in ("SIGINT", "SIGTERM") else skipped_share_error(
        summary["step"], summary["skipped_steps"], cfg.nonfinite.max_skipped_share)
    if failed is not None:  # the entry point prints the line (as after a halt)
        summary.update(stopped_by=SKIPPED_SHARE, stop_reason=failed.why,
                       message=errors.render(failed), exit_code=errors.exit_code(failed))
        run.out.progress.record(summary["message"])
    else:
        run.out.progress.final(summary["message"])
    if jax.process_index() == 0:
        layout.write_file(os.path.join(run.workdir, "summary.json"),
                          json.dumps(summary, indent=2, sort_keys=True))
    if failed is not None:
        failed.summary = summary  # for a script that catches it: the run's result
        raise failed
    return summary


def skipped_share_error(step: int, skipped: int, max_share: float):
    """A NonFiniteError when more than `max_share` of the run's `step` updates were
    skipped (`skipped`), else None. Each skip is only a warning; a run that skipped most
    of its updates ran to the end with a barely trained model, and must not end as done.
    `max_share` 1 = off, 0 = any skipped update fails the run."""
    if step <= 0 or max_share >= 1 or skipped <= max_share * step:
        return None
    error = errors.NonFiniteError(
        f"{skipped} of {step} updates were skipped ({100 * skipped / step:.0f}%), more "
        f"than nonfinite.max_skipped_share={max_share:g}: not done; the steps, reasons and "
        f"examples are in WORKDIR/{ledger_lib.FILE}: fix the data (or raise "
        "nonfinite.max_skipped_share, 1 = off); checkpoints kept")
    error.step = step
    return error


def _best(cfg, run) -> dict:
    """The best step and value of the monitored metric (early_stop / plateau monitor,
    else checkpoint.monitor) over the run's recorded evals, resumes included."""
    out = run.decisions.best()
    if out:
        return out
    key, sign = cfg.checkpoint.monitor, (1.0 if cfg.checkpoint.mode == "min" else -1.0)
    scored = [(sign * e[key], e["step"]) for e in run.ckpt.control.eval_history
              if key in e and np.isfinite(e[key])]
    if not scored:
        return {}
    value, step = min(scored, key=lambda vs: (vs[0], -vs[1]))
    return {"best_metric": key, "best_step": step, "best_value": sign * value}


def _final_line(summary: dict, session) -> str:
    """The one line printed even at verbosity 0 (also in train.log and summary.json)."""
    step, by = summary["step"], summary["stopped_by"]
    rate = summary.get("perf/steps_per_sec")
    tail = ((f"; {rate:.2f} steps/s" if rate else "")
            + (f"; {summary['skipped_steps']} skipped steps" if summary["skipped_steps"]
               else ""))
    evals = evaluator.headline(summary)  # only an eval of `step` is in the summary
    if by in ("SIGINT", "SIGTERM"):
        if step == (summary["resumed_from"] or 0) and session.saved is None:
            return (f"jtrain: stopped by {by} at step {step} during start-up; nothing new "
                    "to save; rerun the same command to continue")
        return (f"jtrain: stopped by {by} at step {step}; checkpoint saved; rerun the same "
                "command to continue")
    if by:
        return (f"jtrain: stopped early at step {step} by {by}: {session.stop_reason}; "
                f"checkpoint saved" + (f"; eval {evals}" if evals else "") + tail)
    return (f"jtrain: done at step {step}" + (f"; eval {evals}" if evals else "") + tail)


def record_halt(run, error: Exception) -> None:
    """A non-finite halt (exit 4): its line into train.log and summary.json; the entry
    point prints it. Nothing is saved (a halt is never checkpointed)."""
    line = errors.render(error)
    run.out.progress.record(line)
    if jax.process_index() == 0:
        summary = {"step": getattr(error, "step", None), "stopped_by": "non-finite",
                   "stop_reason": errors.first_line(error), "message": line,
                   "exit_code": errors.exit_code(error), "resumed_from": run.resumed_from,
                   "checkpoint_step": run.ckpt.latest_step()}
        layout.write_file(os.path.join(run.workdir, "summary.json"),
                          json.dumps(summary, indent=2, sort_keys=True))
