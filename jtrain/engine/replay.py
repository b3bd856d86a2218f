"""`jtrain replay RUN --step S` (= `python -m jtrain.replay`): re-run a recorded step.

Restores the newest checkpoint before step S (a checkpoint at S itself only when it is
the first; with none before S, the run's fresh initialisation from its seed), sets the
data pipeline to that checkpoint's saved position (what a resume does) and runs the
steps up to S with the run's config and jitted step. Then it compares the digest of
the state with the one WORKDIR/hashes.jsonl recorded at S (`debug.hash_every_steps`),
and the step's example indices with the recorded ones. When the hash differs and a
checkpoint of step S exists, it names the first leaf that differs from it and the
largest absolute difference.

Only the workdir is needed (config.json, run.json, hashes.jsonl, checkpoints/), on this
or another machine with the run's device count. A model, loss or data passed to
`jtrain.train` from Python cannot be rebuilt from the config: pass the same objects to
`replay(workdir, step, model=..., train_data=..., eval_data=..., loss_fn=...)` (eval_data
too when the run was given one: without it the train data is split as the run's was not).

Exit codes: 0 reproduced, 7 not reproduced, 2 a bad command line or a path that is not
a run (one line). One JSON line on stdout; the human lines on stderr.
"""

from __future__ import annotations

import functools
import os

import jax
import numpy as np

from jtrain import checkpoint
from jtrain import config as config_lib
from jtrain import data as data_lib
from jtrain import mesh as mesh_lib
from jtrain import precision as precision_lib
from jtrain.engine.assemble import LOSS_SOURCE_KEY, MODEL_SOURCE_KEY, build, model_sample
from jtrain.observe.outputs import TX_SOURCE_KEY
from jtrain.errors import UsageError
from jtrain.observe import hashes as hashes_lib, runfiles, trust
from jtrain.observe import compiles as compiles_lib
from jtrain.observe.outputs import read_run_record


def read_run(workdir: str, flag: str = "RUN") -> dict:
    """A run's config.json; a one-line UsageError for a path that is not a run."""
    path = os.path.join(workdir, "config.json")
    if not os.path.isdir(workdir):
        raise UsageError(flag, f"{workdir} is not a directory (a jtrain run's workdir)")
    try:
        return runfiles.read_object(path)
    except FileNotFoundError:
        raise UsageError(flag, f"{workdir} is not a jtrain run (no config.json)") from None


def replay(workdir: str, step: int, *, model=None, train_data=None, eval_data=None,
           loss_fn=None, say=None, tx=None) -> dict:
    """Re-runs step `step` of the run in `workdir` (see the module docstring); returns
    {"step", "from_step", "recorded", "replayed", "reproduced", "examples_match",
    "leaf", "max_abs_diff"} ("leaf": the first differing leaf against the checkpoint at
    `step`, when the hash differs and that checkpoint exists).

    Examples:
        ```python
        from jtrain.replay import replay

        # runs/a: jtrain.train(config, "runs/a", model=Net, train_data=(x, y)) with
        # config["debug"] = {"hash_every_steps": 10}, the hashes replay compares with
        r = replay("runs/a", 150, model=Net, train_data=(x, y))   # what the run was given
        # a run given eval_data=(xe, ye) too: replay(..., eval_data=(xe, ye))
        assert r["reproduced"], (r["recorded"], r["replayed"], r["leaf"])
        ```
    """
    from flax import linen as nn

    say = say or (lambda line: None)
    shown, workdir = workdir, os.path.abspath(workdir)
    recorded_cfg = read_run(workdir)
    trust.check(workdir, recorded_cfg, shown=shown,  # before anything it names is imported
                skip=(("model.",) * (model is not None) + ("loss.",) * (loss_fn is not None)
                      + ("data.",) * (train_data is not None)))
    records = {int(r["step"]): r for r in hashes_lib.read(workdir)}
    if step not in records:
        listed = sorted(records)
        shown = ", ".join(map(str, listed[:20])) + (", ..." if len(listed) > 20 else "")
        raise UsageError("--step", f"no state hash recorded at step {step} in {workdir}; "
                         + (f"recorded steps: {shown}" if listed else
                            "none recorded (train with debug.hash_every_steps = N)"))
    _check_sources(workdir, model, loss_fn, tx)
    cfg = config_lib.resolve(recorded_cfg)
    config_lib.validate(cfg, num_devices=jax.device_count())
    compiles_lib.configure_cache_for_reader(cfg.compile.cache_dir)
    precision_lib.set_deterministic(cfg.determinism.gpu_ops)
    user = data_lib.UserData(train_data, eval_data, processes=lambda: (0, 1))
    user.settings(cfg.data)
    data = data_lib.prepare(cfg.data, user, seed=cfg.seed, gather=mesh_lib.process_values,
                            cache=workdir)
    b = build(cfg, sample=model_sample(cfg, data.train_example), eval_example=data.example,
              model=model, loss_fn=loss_fn, byte_level=data.byte_level,
              train_example=data.train_example, tx=tx)
    reader = checkpoint.CheckpointReader(workdir)
    steps = reader.all_steps()
    before = [s for s in steps if s < step] or [s for s in steps if s == step]
    target = b.abstract_with_shardings()
    if before:
        start = before[-1]
        state, data_state, control = reader.restore(start, target)
        _check_data(data.info, control.get("data_info", {}), workdir)
    elif cfg.init.path:
        raise UsageError("--step", f"no checkpoint at or before step {step} in {workdir}, "
                         "and the run started from init.path: nothing to "
                         "replay from")
    else:
        start, state, data_state = 0, b.init(), None
    say(f"jtrain: replay: from {'step ' + str(start) if start else 'the initial state'}"
        f" to step {step} ({step - start} steps)")
    train_iter = data.train_iterator(data_state, functools.partial(mesh_lib.host_to_device,
                                                                   mesh=b.mesh))
    batch_of, indices_of = data.batch_positions(train_iter.get_state(), start + 1)
    try:
        with jax.set_mesh(b.mesh), nn.logical_axis_rules(mesh_lib.LOGICAL_RULES):
            for _ in range(start, step):
                state, metrics = b.train_step(state, next(train_iter))
                jax.block_until_ready(metrics["train/status"])  # few steps in flight
            got = hashes_lib.state_digest(state, b.mesh)
    finally:
        train_iter.close()
    want = records[step]
    examples = indices_of(batch_of(step))
    result = {"step": step, "from_step": start, "recorded": want["hash"],
              "replayed": got["hash"], "reproduced": got["hash"] == want["hash"],
              "examples_match": (None if want.get("examples") is None or examples is None
                                 else list(examples) == list(want["examples"])),
              "leaf": None, "max_abs_diff": None}
    if not result["reproduced"]:
        result["parts"] = sorted(k for k, v in got["parts"].items()
                                 if want.get("parts", {}).get(k) != v)
        if step in steps and start != step:
            saved = reader.restore(step, target)[0]
            found = hashes_lib.first_difference(_host(state), _host(saved))
            if found is not None:
                result["leaf"], result["max_abs_diff"] = found
    return result


def _host(state) -> dict:
    """The state as a nested dict of numpy arrays (gathered across processes)."""
    from jax.experimental import multihost_utils

    def fetch(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            x = multihost_utils.process_allgather(x, tiled=True)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return {hashes_lib.leaf_path(p): fetch(x)
            for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}


def _check_sources(workdir: str, model, loss_fn, tx) -> None:
    sources = read_run_record(workdir)
    for key, given, arg in ((MODEL_SOURCE_KEY, model, "model"),
                            (LOSS_SOURCE_KEY, loss_fn, "loss_fn"), (TX_SOURCE_KEY, tx, "tx")):
        if sources.get(key) and given is None:
            raise UsageError("RUN", f"{workdir} was trained with a {arg} passed from Python "
                             f"({sources[key].split(': ', 1)[-1]}); the command line cannot "
                             f"rebuild it: call jtrain.replay.replay(workdir, step, "
                             f"{arg}=...) from Python")


def _check_data(now: dict, saved: dict, workdir: str) -> None:
    """The data prepared here is the run's (its name, size and fingerprint)."""
    keys = ("name", "num_examples", "fingerprint")
    a, b = ({k: d[k] for k in keys if k in d} for d in (now, saved))
    if a != b:
        raise UsageError("RUN", f"the data here ({a}) is not the data {workdir} was trained "
                         f"on ({b}); data passed from Python: call jtrain.replay.replay("
                         "workdir, step, train_data=...)")
