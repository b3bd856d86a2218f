"""Hyperparameter search with retrain-on-best: `python -m jtrain.tune`.

    python -m jtrain.tune --config=configs/x.py --workdir=runs/search [--tune.storage=URL]

The config's `tune.*` keys (jtrain/config/schema.py) say what to search (`tune.space`),
how many trials, what to optimise and how to sample and prune. An Optuna study in a real
database (`sqlite:///WORKDIR/study.db` unless `tune.storage` names another) holds the
trials, so several workers can share it and a killed worker's rerun continues. Each trial
is a jtrain run in WORKDIR/trials/<n> (WORKDIR may be a bucket: s3://bucket/study). The
search writes WORKDIR/trials.jsonl, WORKDIR/best_config.py (retrain with `python -m
jtrain.main --config=...`) and WORKDIR/tune.png. Optuna is an extra: `pip install
'jtrain[tune]'`. The command (its flags, the worker loop, the job broadcast) is
jtrain/tune/command.py.

    study.py     storage, sampler, pruner, the next trial, killed trials, heartbeats
    trial.py     one trial: sampled params -> config -> jtrain.train -> outcome
    batch.py     tune.population > 1: K trials as the members of one population run
    results.py   trials.jsonl, best_config.py, tune.png
    bucket.py    a search on an object store: the study's files staged, uploaded, leased
"""


def main(argv=None) -> int:
    """The command (`jtrain tune` dispatches here): returns the exit code."""
    import sys

    from jtrain import cli

    return cli.run_command("tune", sys.argv[1:] if argv is None else argv)
