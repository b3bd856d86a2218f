"""What a run shows and records; process 0 only.

    console   the progress bar / plain lines, train.log, warnings once (Progress, say)
    outputs   opened once per run: config.json, run.json (model/loss source, what the
              set-up decided), writers, progress, header, perf meter, profiler
    header    the run header and the parameter table printed before training
    trust     config.json.sig: runs signed with the user's key; a run naming code it
              did not sign is not opened (jtrain trust RUN)
    layout    every file a run's workdir holds (docs/reference/workdir.md), start-up
              order; the one writer of run files (never through a link)
    runfiles  the one reader of run files: regular files only, capped, strictly decoded,
              anything malformed one line naming the file
    liblogs   library logs (orbax, absl, grain) and error tracebacks into train.log
    writers   metric writers: JSONL, TensorBoard, MLflow, W&B (background thread)
    writer_checks  each writer checked at start-up: the MLflow store, writable folders
    jsonl     the metrics.jsonl format; a resumed run's records truncated to its step
    hashes    hashes.jsonl (debug.hash_every_steps): exact on-device state digests and
              each recorded step's example indices, for jtrain diff / replay
    perf      steps/s, tokens/s, MFU, data wait, compile time; the profiler
    plots     PNG plots for `python -m jtrain.evaluate` (curves, confusion, goodput.png)
    startup   time to first step split into phases, in the header and summary.json
    compiles  the persistent compilation cache; every compile counted, recompiles named
    goodput   every second of a run over its sessions (goodput.jsonl): productive,
              start-up, compile, checkpoints, eval, data, recomputed, restart gaps
    tbx       tensorboardX's event-file modules without its torch import
"""
