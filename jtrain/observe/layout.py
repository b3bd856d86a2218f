"""What a run's workdir (and a search's) holds, entry by entry: the one list that
docs/reference/workdir.md is written from (`python -m jtrain.reference`) and that a test
checks a real run's workdir against, with the start-up precedence a rerun follows; and
the two ways jtrain writes a file into a workdir without following a link out of it:
`write_file` (a whole file: a temporary file beside it, then os.replace, which replaces a
symlink at the path instead of writing through it) and `open_append` (O_NOFOLLOW: a
symlink or another non-regular file at the path is one WorkdirError)."""

from __future__ import annotations

import errno
import fnmatch
import os
import secrets
import stat

from jtrain.errors import WorkdirError


def write_file(path: str, content: str | bytes) -> None:
    """Writes `content` as the whole file at `path`: a new file beside it (created, never
    opened through a link) renamed over it. The file at `path` afterwards is jtrain's,
    whatever was there (a symlink is replaced, its target left as it was)."""
    tmp = os.path.join(os.path.dirname(path),
                       f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def open_append(path: str):
    """`path` opened for appending text (created if missing), never through a symlink and
    never a FIFO or a device: those are one WorkdirError naming the path."""
    fd = _open_regular(path, os.O_WRONLY | os.O_APPEND)
    return os.fdopen(fd, "a", encoding="utf-8")


def open_update(path: str) -> int:
    """`path` opened for reading and writing in place (created if missing; no O_APPEND,
    so pwrite writes where it is told), with open_append's checks; a file descriptor."""
    return _open_regular(path, os.O_RDWR)


def _open_regular(path: str, mode: int) -> int:
    flags = mode | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW, 0o666)
    except OSError as e:
        if e.errno != errno.ELOOP and not (e.errno == errno.ENXIO or os.path.islink(path)):
            raise
        fd = -1
    if fd < 0 or not stat.S_ISREG(os.fstat(fd).st_mode):
        if fd >= 0:
            os.close(fd)
        raise WorkdirError(path, "is a symlink or not a regular file; jtrain writes only "
                           "files inside the run (remove it, or use another --workdir)")
    os.set_blocking(fd, True)
    return fd

# The folders jtrain writes into: files are created inside them by name (orbax, the
# TensorBoard writer, the profiler), so a symlink planted there would send those writes
# out of the run.
FOLDERS = ("checkpoints", "checkpoints.damaged", "tb", "evals", "profile", "logs", "wandb",
           "token_shards")


def check_folders(workdir: str) -> None:
    """A WorkdirError naming the first of the run's folders that is a symlink (checked at
    start-up, before anything is written)."""
    for name in FOLDERS:
        path = os.path.join(workdir, name)
        if os.path.islink(path):
            raise WorkdirError(path, "is a symlink; jtrain writes only inside the run, "
                               "never through a link (replace it by a folder, or use "
                               "another --workdir)")


EVALS = "evals"  # eval.mode=async / jtrain evaluate --follow: one result file per step


def eval_result_path(workdir: str, step: int) -> str:
    """WORKDIR/evals/<step>.json: the evaluation of checkpoint `step` by `jtrain evaluate
    --follow`."""
    return os.path.join(workdir, EVALS, f"{int(step)}.json")


def write_eval_result(workdir: str, step: int, record: dict) -> None:
    """The result file of `step`, written whole (a reader never sees half of it)."""
    import json

    os.makedirs(os.path.join(workdir, EVALS), exist_ok=True)
    write_file(eval_result_path(workdir, step), json.dumps(record, sort_keys=True))


def read_eval_result(workdir: str, step: int) -> dict | None:
    """The result file of `step`, or None while there is none; one that is not a result
    (not a JSON object, metrics not numbers, a link, a FIFO) is one WorkdirError."""
    from jtrain.observe import runfiles

    path = eval_result_path(workdir, step)
    try:
        record = runfiles.read_object(path)
    except FileNotFoundError:
        return None
    if "skipped" not in record:
        problem = runfiles.check_fields(record, {"metrics": dict})
        problem = problem or runfiles.check_fields(
            record["metrics"], dict.fromkeys(record["metrics"], float))
        if problem is not None:
            raise WorkdirError(path, problem)
    return record


def eval_result_steps(workdir: str) -> set[int]:
    """The steps that have a result file."""
    try:
        names = os.listdir(os.path.join(workdir, EVALS))
    except FileNotFoundError:
        return set()
    return {int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit()}


# (shown name, fnmatch patterns of the top-level entries it stands for, what it holds)
RUN = (
    ('config.json', 'config.json',
     'exactly the resolved config (secrets redacted), written at start; it feeds back unchanged '
     'into jtrain.train / jtrain.resolve'),
    ('config.json.sig', 'config.json.sig',
     'the HMAC-SHA256 of config.json under the user\'s key (jtrain.observe.trust), written with '
     'it: evaluate, replay and report open a run whose config names code beyond the short list '
     'of jtrain\'s recipe factories (trust.UNSIGNED) only when it verifies (`jtrain trust RUN` '
     'signs a run from elsewhere)'),
    ('run.json', 'run.json',
     'the run\'s records beside the config: "model_source" / "loss_source" when the model / '
     'loss_fn came from Python (not rebuildable), and "decided": what the set-up chose beyond '
     'the config, e.g. {"optim.grad_accum_steps": {"value": 2, "from": "memory plan", ...}, '
     '"data.batch_size": {"value": 32, "from": "DataLoader"}} (also in summary.json); older runs '
     'kept model_source in config.json'),
    ('tokenizer.json | tokenizer.model', 'tokenizer.*',
     'with data.name=tokens and a tokenizer other than bytes: a copy of the shards\' '
     'tokenizer (written at start; `jtrain export --format=hf` carries a tokenizer.json)'),
    ('token_shards/', 'token_shards',
     'with data.name=tokens and data.path on s3:// or gs://: the shards and tokenizer '
     'fetched once, under their index fingerprint, each hashed as it arrived'),
    ('metrics.jsonl', 'metrics.jsonl',
     'one JSON object per log step / eval: {"step", "time", "train/loss", ...}; train/loss is '
     'the log step\'s own batch, train/loss_window the mean over the log window\'s applied steps '
     '(what the progress bar shows; after a resume the first window starts at the restored '
     'step); a resumed run first drops the records after its restored step'),
    ('skipped.jsonl', 'skipped.jsonl',
     'the skip ledger: every skipped update (step, reason, batch, examples)'),
    ('hashes.jsonl', 'hashes.jsonl',
     'with debug.hash_every_steps = N: every N steps {"step", "hash" (the whole train state, '
     'exact), "parts" (params, opt_state, ema, rest), "examples" (the batch\'s global example '
     'indices)}; read by jtrain diff and jtrain replay; a resumed run first drops the records '
     'after its restored step'),
    ('goodput.jsonl', 'goodput.jsonl',
     'the goodput ledger: one fixed-width line per session (each call of the run), updated in '
     'place after every step, eval and save: its start, its last step and time, its seconds '
     'per category (startup, steps, compile, checkpoints, eval, data, other), the start-up '
     'phases, the step seconds at each save; summary.json\'s "goodput" adds them up over the '
     'sessions'),
    ('faults.jsonl', 'faults.jsonl',
     'with debug.faults: one line per injected fault that fired {"fault", "process", "step", '
     '"time"}, written before it acts; a fault listed here never fires again in this run'),
    ('goodput.png', 'goodput.png',
     'from jtrain evaluate: goodput.jsonl drawn, one stacked bar of seconds by category per '
     'session (its numbers also in the PNG\'s "goodput" text field)'),
    ('tb/', 'tb',
     'TensorBoard event files (tensorboard --logdir WORKDIR/tb)'),
    ('checkpoints/N/', 'checkpoints',
     'orbax step directories: state (TrainState), data (iterator position), control (run-control '
     'record: config + hash, versions, writer run ids, best-k registry, eval history, early-stop '
     '/ plateau / spike state, skip ledger), jtrain_manifest.json (checksums)'),
    ('checkpoints.damaged/', 'checkpoints.damaged',
     'damaged checkpoints moved aside at start-up (never deleted)'),
    ('local_tier.json', 'local_tier.json',
     'with checkpoint.local_dir: {"id"}, the name of this run\'s folder in the local tier '
     '(LOCAL_DIR/<id>/<step>/, its newest step only; LOCAL_DIR/<id>/tier_owner.json: '
     'the workdir that owns it)'),
    ('summary.json', 'summary.json',
     'at the end: step, state_sha256, final eval metrics (only an eval of that step; an older '
     'one is "last_eval" with its step), best_step / best_value, stopped_by / stop_reason, '
     'skipped_steps, lr_factor, rollbacks ([spike step, restored step]), message (the run\'s '
     'last line), exit_code and decided (as in run.json); after a non-finite halt: stopped_by '
     '"non-finite", message, exit_code 4, checkpoint_step; a run that ended with more than '
     'nonfinite.max_skipped_share of its updates skipped: the full summary with stopped_by '
     '"max_skipped_share", exit_code 4; perf/*, startup/<phase>_sec (time to first step by '
     'phase), compile/* (count, seconds, cache hits / misses, compiles after the first step with '
     'their cause); goodput: the run\'s wall time over all its sessions by category (productive, '
     'startup, compile, checkpoints, eval, data, recomputed, restart_gaps, other: seconds), '
     'fraction (productive / total), sessions, steps computed and recomputed; with data.mixture, '
     'data.mixture: {component: {weight (at the last batch), '
     'size ("stream" for a stream component), draws, epochs (draws / size; a stream: its '
     'completed passes)}}'),
    ('population.png', 'population.png',
     'a population run (population.size > 1), at the end: per train / eval metric each member\'s '
     'curve, the mean over the members and the winner (the best last value; lower is better for '
     'losses)'),
    ('hang.log', 'hang.log',
     'the line and the stacks of all threads when the watchdog fired (exit 5)'),
    ('train.log', 'train.log',
     'everything printed at verbosity >= 1, warnings de-duplicated; below verbosity 2 also the '
     'logs of orbax / absl / grain and the traceback behind an error line'),
    ('profile/', 'profile',
     'jax.profiler traces when profile.num_steps > 0 (TensorBoard profile plugin)'),
    ('evals/<step>.json', 'evals',
     'eval.mode=async and jtrain evaluate --follow: the evaluation of checkpoint <step> by the '
     'evaluator process {"step", "metrics", "num_examples", "skipped" (the checkpoint was '
     'deleted before it was read)}, written whole; an async run applies it eval.async_lag '
     'evaluation points later and writes it to metrics.jsonl then'),
    ('eval_<step>.json', 'eval_*',
     'from python -m jtrain.evaluate, with eval_<step>_curves.png (and eval_<step>_confusion.png '
     'for classification)'),
    ('logs/', 'logs',
     'per-process logs of launch/local.sh'),
    ('mlflow.db, wandb/', 'mlflow.db wandb',
     'the MLflow store and the W&B offline run, only when those writers are enabled'),
)

SEARCH = (
    ('study.db', 'study.db',
     'the Optuna study (SQLite) unless tune.storage names another database'),
    ('trials/<n>/', 'trials',
     "trial n's jtrain run (a run's workdir, as above); a killed trial's continuation keeps the "
     "first trial's folder"),
    ('trials.jsonl', 'trials.jsonl',
     'every trial: number, state (complete, pruned, failed, interrupted, running, waiting), '
     'value, params, step, workdir, reason, continues, resumed_from; rewritten after each trial'),
    ('best_config.py', 'best_config.py',
     'get_config() of the best complete trial (tune.* left out; secrets masked, one comment '
     'line per masked key)'),
    ('tune.png', 'tune.png',
     'optimisation history and parameter importances'),
)

PRECEDENCE = """\
`checkpoint.Checkpointer.restore_or_init` (called from `train._train`) decides, in order:

1. **The newest complete, intact checkpoint in `WORKDIR/checkpoints`.** Leftovers of a
   killed save (`*.orbax-checkpoint-tmp*`) are removed; a step directory whose manifest
   is missing or whose files do not match their recorded size and CRC-32 (or that is a
   file or a symlink) is reported in one line and moved to `WORKDIR/checkpoints.damaged/`,
   and the next older one is tried (`--strict_restore`: exit 3 instead). The saved config
   is compared with the current one: changed keys whose `resume` rule is false in the
   schema need `checkpoint.allow_changes` (else exit 3 with the diff); the saved tree
   must equal the model's (else exit 3 naming the leaf). The data position, RNG, loss
   scale, best-k registry and writer run ids continue from it. With
   `checkpoint.local_dir` the local tier is scanned the same way (damaged steps go to
   `LOCAL_DIR/<id>.damaged/`) and the newer of the two tiers' newest intact steps is
   restored (a tie: the persistent one); an empty or missing local tier means
   `WORKDIR/checkpoints`.
2. **Else `init.path`** (an export or another run's workdir/step, read only):
   params, plus optimizer state with `init.opt`, minus
   `init.exclude` regexes; the run starts at step 0 with a fresh data order.
3. **Else a fresh init** from `seed`.
"""


def listed(entry: str, layout=RUN) -> bool:
    """Whether a top-level name in a workdir is one the layout describes."""
    return any(fnmatch.fnmatch(entry, p) for _, patterns, _ in layout
               for p in patterns.split())


def markdown() -> str:
    """docs/reference/workdir.md."""
    out = ["# A run's workdir", "",
           "<!-- Generated by `python -m jtrain.reference --write docs/reference` from "
           "jtrain/observe/layout.py; do not edit. -->", "",
           "The workdir is the run's identity: running the same command again resumes. "
           "Outside it: the persistent XLA compilation cache shared by all runs "
           "(`compile.cache_dir`; safe to delete). `--dry_run` writes nothing.", "",
           "| entry | what it holds |", "|---|---|"]
    out += [f"| `{name}` | {about} |" for name, _, about in RUN]
    out += ["", "## A search's workdir (`python -m jtrain.tune`)", "",
            "| entry | what it holds |", "|---|---|"]
    out += [f"| `{name}` | {about} |" for name, _, about in SEARCH]
    out += ["", "## Start-up precedence", "", PRECEDENCE]
    return "\n".join(out)
