"""The schema's run-control sections: compile cache, profiler, checkpoints, early stop,
plateau, non-finite and spike handling, watchdog, distributed start-up, memory planning,
the tuner. jtrain.config.schema places them after the core sections."""

from __future__ import annotations

from typing import Any

from jtrain.config.fields import F, INF, INT_MAX, SPACE_KINDS, _resume_safe

CONTROL_SECTIONS: dict[str, Any] = {
    "compile": _resume_safe({  # jtrain/observe/compiles.py
        "cache_dir": F(str, "auto", None, "persistent XLA compilation cache shared by "
                       "runs and processes; auto = $XDG_CACHE_HOME/jtrain/xla or "
                       "~/.cache/jtrain/xla; '' = off"),
        "cache_max_gb": F(float, 8.0, (0.0, INF), "least-recently used cache entries "
                          "are evicted past this size; 0 = no limit"),
        "precompile": F(bool, True, None, "compile the train step in a background "
                        "thread while the state initialises (its first call reuses it)"),
    }),
    "profile": _resume_safe({
        "start_step": F(int, 0, (0, INF), "first traced step; 0 = no jax.profiler trace"),
        "num_steps": F(int, 5, (1, INF), "steps traced into WORKDIR/profile"),
    }),
    "perf": _resume_safe({
        "peak_flops": F(float, 0.0, (0.0, INF), "peak FLOP/s per device for MFU; 0 = from "
                        "the device kind"),
    }),
    "checkpoint": _resume_safe({  # read by jtrain.checkpoint
        "every_steps": F(int, 500, (0, INF), "save every N steps; 0 = only at the end"),
        "every_seconds": F(float, 0.0, (0.0, INF), "also save every N seconds; 0 = off"),
        "max_to_keep": F(int, 3, (1, INF), "keep the latest K (the latest always stays)"),
        "keep_every_steps": F(int, 0, (0, INF), "also keep steps that are multiples of N"),
        "keep_top_k": F(int, 1, (0, INF), "also keep the k best by monitor"),
        "monitor": F(str, "eval/loss", None, "metric ranking checkpoints"),
        "mode": F(str, "min", ("min", "max"), "whether lower or higher monitor is better"),
        "async_save": F(bool, True, None, "write in the background"),
        "grace_seconds": F(float, 30.0, (0.0, 86400.0), "SIGTERM/SIGINT: time to save "
                           "and exit"),
        "strict_restore": F(bool, False, None, "a damaged checkpoint ends the run (exit 3) "
                            "instead of falling back"),
        "allow_changes": F("strs", (), None, "config keys (fnmatch) that may change on "
                           "resume"),
        "local_dir": F(str, "", None, "a folder on this machine's disk for the fast local "
                       "tier (its newest step only); '' = off"),
        "local_every_steps": F(int, 0, (0, INF), "save to the local tier every N steps "
                               "(steps the persistent tier saves excepted)"),
        "save_on_best": F(bool, True, None, "an eval that enters the keep_top_k best saves "
                          "its step (when keep_top_k > 0)"),
    }),
    # A new run's starting state (jtrain/checkpoint/init_from.py), read only when the
    # workdir has no checkpoint yet.
    "init": _resume_safe({
        "path": F(str, "", None, "an export, a run (its workdir) or hf:DIR to start "
                   "from when the workdir has no checkpoint; '' = a fresh init"),
        "step": F(str, "", None, "init.path a run: its step N, latest (\"\" = the "
                   "newest intact) or best (by its checkpoint.monitor)"),
        "opt": F(bool, False, None, "also take the optimizer state"),
        "into": F(str, "", None, "a sub-tree of the state (a step of your own's "
                   "teacher) that init.path fills, as if it were the whole model; "
                   "'A,B' = each of several (DPO's policy and reference); '' = the "
                   "model's parameters"),
        "exclude": F("strs", (), None, "regexes of parameter paths (o/kernel, no "
                     "params/) that keep a fresh init"),
        "map": F("pairs", (), None, "(regex, replacement) pairs renaming the source's "
                 "parameter paths (or HF tensor names) to the model's (re.sub, first "
                 "match; a trailing .T transposes): hf:DIR into your own model"),
    }),
    # Run control (jtrain/control): decisions from globally reduced values, state in
    # the checkpoint.
    "early_stop": _resume_safe({
        "monitor": F(str, "", None, "eval metric to watch, e.g. eval/f1; '' = off"),
        "mode": F(str, "min", ("min", "max"), "whether lower or higher is better"),
        "patience": F(int, 5, (1, INF), "evals without improvement before stopping"),
        "min_delta": F(float, 0.0, (0.0, INF), "smallest change that counts as better"),
        "stopping_threshold": F("optfloat", None, None, "stop once the metric is at least "
                                "this good"),
        "divergence_threshold": F("optfloat", None, None, "stop once the metric is worse "
                                  "than this"),
        "check_finite": F(bool, True, None, "stop when the metric is NaN or infinite"),
    }),
    "plateau": {  # changes the learning rate from here on: not resume-safe
        "monitor": F(str, "", None, "eval metric driving ReduceLROnPlateau; '' = off"),
        "mode": F(str, "min", ("min", "max"), "whether lower or higher is better"),
        "factor": F(float, 0.1, (0.0, 1.0), "multiply the learning rate by this, in (0, 1)"),
        "patience": F(int, 3, (0, INF), "evals without improvement before reducing"),
        "cooldown": F(int, 0, (0, INF), "evals to wait after a reduction"),
        "min_lr": F(float, 0.0, (0.0, INF), "optim.lr x the plateau factor never goes "
                     "below this"),
        "min_delta": F(float, 1e-4, (0.0, INF), "smallest change that counts as better"),
    },
    "control": {  # jtrain/control/rule.py; the rules change the trajectory: not resume-safe
        "callbacks": F("strs", (), None, "'package.module:Class' (or a function) of run-"
                       "control rules of your own, each called with no arguments: "
                       "after_step / after_log / after_eval may stop the run, scale the "
                       "learning rate, log callback/* scalars or save the step"),
    },
    "nonfinite": _resume_safe({
        "policy": F(str, "skip", ("skip", "halt"), "a non-finite loss or gradient norm: "
                    "skip the update, or halt (exit 4)"),
        "max_consecutive": F(int, 8, (1, INF), "skip: halt after this many skips in a row"),
        "max_skipped_share": F(float, 0.5, (0.0, 1.0), "a run that ends with more than "
                               "this share of its updates skipped (skipped_steps / step: "
                               "invalid batches, non-finite steps, rolled-back steps) fails "
                               "(exit 4, checkpoints kept) instead of ending done; 1 = off, "
                               "0 = any skipped update fails it"),
    }),
    "spike": {  # changes the trajectory: not resume-safe
        "zscore": F(float, 0.0, (0.0, INF), "a train loss this many standard deviations "
                    "above the last spike.window steps' mean rolls the run back to the "
                    "newest checkpoint before it and skips the batches since; 0 = off"),
        "window": F(int, 50, (5, 100_000), "steps of train loss the z-score is taken over"),
        "lr_factor": F(float, 1.0, (0.0, 1.0), "learning-rate factor applied at each "
                       "rollback (1 = unchanged)"),
        "max_rollbacks": F(int, 3, (1, INF), "one more spike after this many rollbacks "
                           "halts the run (exit 4)"),
    },
    "watchdog": _resume_safe({
        "timeout_s": F(float, -1.0, (-1.0, INF), "a step, eval or save taking longer "
                       "dumps all stacks and exits 5; 0 = off, -1 = 1800 s with several "
                       "processes, off with one"),
        "first_timeout_s": F(float, 3600.0, (0.0, INF), "allowance for start-up and the "
                             "first step (compile)"),
    }),
    "distributed": _resume_safe({  # jtrain/multihost; read before jax.distributed starts
        "init_timeout_s": F(float, 900.0, (1.0, 86400.0), "start-up: every process must "
                            "reach the coordinator within this (cold starts: image pulls, "
                            "queued pods); else one line naming the missing ids, exit 5"),
        "heartbeat_timeout_s": F(float, 120.0, (1.0, 86400.0), "a peer silent this long "
                                 "(killed, stopped, host gone) ends every survivor with one "
                                 "line, exit 5"),
        "debug_every_steps": F(int, 0, (0, INF), "--debug_multihost: every N steps all "
                               "processes must be at the same step with the same config "
                               "hash; 0 = off"),
    }),
    "memory": _resume_safe({
        "budget_bytes": F(float, 0.0, (-1.0, INF), "per-device bytes the train step may "
                          "use; over it, grad_accum_steps is raised until it fits "
                          "(control.memory); 0 = no planning, -1 = the device's own "
                          "limit (none known on CPU)"),
    }),
    # python -m jtrain.tune (jtrain/tune): read by the tuner only; a plain run ignores it.
    "tune": _resume_safe({
        "space": F("dict", {}, None, "searched keys: {'optim': {'lr': ('log_uniform', "
                   "1e-4, 1e-1)}, 'data': {'batch_size': ('choice', (16, 32))}} (or dotted "
                   "keys from Python); kinds: " + ", ".join(SPACE_KINDS)),
        "trials": F(int, 20, (1, INF), "trials the study runs to the end (complete, pruned "
                    "or failed; a killed trial is continued, not counted twice)"),
        "monitor": F(str, "eval/loss", None, "eval metric optimised: its value at a "
                     "trial's last eval; every eval reports it to the pruner"),
        "mode": F(str, "min", ("min", "max"), "minimise or maximise tune.monitor"),
        "sampler": F(str, "tpe", ("tpe", "random"), "Optuna sampler, seeded with "
                     "tune.seed + the trial number"),
        "seed": F(int, 0, (0, INT_MAX), "seed of the sampler (not of the trials' runs)"),
        "pruner": F(str, "median", ("median", "hyperband", "none"), "stop unpromising "
                    "trials at an eval (Optuna MedianPruner / HyperbandPruner)"),
        "prune_startup_trials": F(int, 5, (0, INF), "median: finished trials before "
                                  "pruning starts"),
        "prune_warmup_steps": F(int, 0, (0, INF), "no pruning at evals before this step"),
        "storage": F(str, "", None, "Optuna RDB URL shared by workers (sqlite:///f.db, "
                     "postgresql://user@host/db; its password in $JTRAIN_TUNE_DB_PASSWORD); '' = "
                     "sqlite:///WORKDIR/study.db"),
        "study_name": F(str, "", None, "study in the storage; '' = the workdir's name"),
        "stale_after_s": F(float, 300.0, (1.0, INF), "a running trial whose worker has "
                           "not beaten its heartbeat this long is continued by another "
                           "(on the same host: as soon as the worker's process is gone)"),
        "population": F(int, 1, (1, 1024), "trials trained together as one population "
                        "run (population.*; every tune.space key must be one a population "
                        "can vary); > 1: no pruning, one worker per study; 1 = one run "
                        "per trial"),
    }),
    # Run forensics (WORKDIR/hashes.jsonl, read by `jtrain diff` and `jtrain replay`) and
    # faults injected on purpose (debug.faults).
    "debug": _resume_safe({  # read by jtrain.observe.hashes (the loop records)
        "hash_every_steps": F(int, 0, (0, INF), "every N steps, record an exact digest of "
                              "the whole train state and the step's example indices in "
                              "WORKDIR/hashes.jsonl (jtrain diff, jtrain replay); 0 = off"),
        # read by jtrain.control.faults; the syntax in docs/guide/run-control.md
        "faults": F(str, "", None, "faults injected on purpose, each fired once per run "
                    "(WORKDIR/faults.jsonl): 'kill@7,nan@12,hang@20:p1,slow@5-9:p0:0.2s,"
                    "torn_ckpt@10,writer_fail@15'; '' = none"),
    }),
    # The same bits on any number of devices (jtrain.invariant, docs/guide/determinism.md).
    "determinism": {
        "gpu_ops": F(bool, False, None, "deterministic GPU ops (XLA flags set before the "
                     "backend starts); CPU is deterministic already", resume=True),
        "topology_invariant": F(bool, False, None, "train and evaluate with every sum "
                                "across devices in a fixed order: the same state, hashes, "
                                "metrics and evals on 1, 2, 4 or 8 devices (data and fsdp "
                                "axes), in one process or several, and across an elastic "
                                "resume; costs whole params and gradients on every device "
                                "during the update (no tensor parallelism, no population)"),
        "chunks": F(int, 8, (1, 4096), "topology_invariant: the global batch (and each eval "
                    "batch) is cut into this many equal chunks whatever the device count; "
                    "it must divide the batch and be a multiple of data x fsdp"),
    },
}
