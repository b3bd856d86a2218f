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
`replay(workdir, step, model=..., train_data=..., loss_fn=...)`.

Exit codes: 0 reproduced, 7 not reproduced, 2 a bad command line or a path that is not
a run (one line). One JSON line on stdout; the human lines on stderr.
"""

from __future__ import annotations

if __name__ == "__main__":  # process start-up before JAX is imported (jtrain.boot)
    from jtrain import boot

    boot.start("replay")

import functools  # noqa: E402
import json
import os
import sys

import jax
import numpy as np
from absl import flags
from absl import logging as absl_logging

from jtrain import checkpoint, cli
from jtrain import config as config_lib
from jtrain import data as data_lib
from jtrain import mesh as mesh_lib
from jtrain import precision as precision_lib
from jtrain.build import LOSS_SOURCE_KEY, MODEL_SOURCE_KEY, build, model_sample
from jtrain.errors import EXIT_DIFFERENT, UsageError
from jtrain.observe import hashes as hashes_lib
from jtrain.observe.outputs import read_run_record


def read_run(workdir: str, flag: str = "RUN") -> dict:
    """A run's config.json; a one-line UsageError for a path that is not a run."""
    path = os.path.join(workdir, "config.json")
    if not os.path.isdir(workdir):
        raise UsageError(flag, f"{workdir} is not a directory (a jtrain run's workdir)")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        raise UsageError(flag, f"{workdir} is not a jtrain run (no readable config.json)"
                         ) from None


def replay(workdir: str, step: int, *, model=None, train_data=None, loss_fn=None,
           say=None) -> dict:
    """Re-runs step `step` of the run in `workdir` (see the module docstring); returns
    {"step", "from_step", "recorded", "replayed", "reproduced", "examples_match",
    "leaf", "max_abs_diff"} ("leaf": the first differing leaf against the checkpoint at
    `step`, when the hash differs and that checkpoint exists)."""
    from flax import linen as nn

    say = say or (lambda line: None)
    workdir = os.path.abspath(workdir)
    recorded_cfg = read_run(workdir)
    records = {int(r["step"]): r for r in hashes_lib.read(workdir)}
    if step not in records:
        listed = sorted(records)
        shown = ", ".join(map(str, listed[:20])) + (", ..." if len(listed) > 20 else "")
        raise UsageError("--step", f"no state hash recorded at step {step} in {workdir}; "
                         + (f"recorded steps: {shown}" if listed else
                            "none recorded (train with debug.hash_every_steps = N)"))
    _check_sources(workdir, model, loss_fn)
    cfg = config_lib.resolve(recorded_cfg)
    config_lib.validate(cfg, num_devices=jax.device_count())
    precision_lib.set_deterministic(cfg.deterministic)
    user = data_lib.UserData(train_data, None, processes=lambda: (0, 1))
    user.settings(cfg.data)
    data = data_lib.prepare(cfg.data, user, seed=cfg.seed, gather=mesh_lib.process_values)
    b = build(cfg, sample=model_sample(cfg, data.train_example), eval_example=data.example,
              model=model, loss_fn=loss_fn, byte_level=data.byte_level,
              train_example=data.train_example)
    reader = checkpoint.CheckpointReader(workdir)
    steps = reader.all_steps()
    before = [s for s in steps if s < step] or [s for s in steps if s == step]
    target = b.abstract_with_shardings()
    if before:
        start = before[-1]
        state, data_state, control = reader.restore(start, target)
        _check_data(data.info, control.get("data_info", {}), workdir)
    elif cfg.checkpoint.init_from:
        raise UsageError("--step", f"no checkpoint at or before step {step} in {workdir}, "
                         "and the run started from checkpoint.init_from: nothing to "
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


def _check_sources(workdir: str, model, loss_fn) -> None:
    sources = read_run_record(workdir)
    for key, given, arg in ((MODEL_SOURCE_KEY, model, "model"),
                            (LOSS_SOURCE_KEY, loss_fn, "loss_fn")):
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


def _define_flags(fv) -> None:
    flags.DEFINE_integer("step", None, "The recorded step to replay (required).",
                         flag_values=fv)
    flags.DEFINE_string("workdir", None, "The run's directory (or give it as the argument).",
                        flag_values=fv)


def _main(fv, args) -> int:
    workdir = fv.workdir or (args[0] if len(args) == 1 else None)
    if workdir is None or len(args) > (0 if fv.workdir else 1):
        raise UsageError("usage: jtrain replay RUN --step S")
    if fv.step is None:
        raise UsageError("--step", "required: the recorded step to replay")
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every restore at INFO

    def say(line):
        sys.stderr.write(line + "\n")

    result = replay(workdir, fv.step, say=say)
    if result["reproduced"]:
        say(f"jtrain: replay: step {fv.step} reproduced bitwise (hash "
            f"{result['replayed'][:16]}...)")
    else:
        where = (f"; first differing leaf against checkpoint {fv.step}: {result['leaf']} "
                 f"(max abs diff {result['max_abs_diff']:.3g})" if result["leaf"] else "")
        say(f"jtrain: replay: step {fv.step} NOT reproduced: recorded hash "
            f"{result['recorded'][:16]}..., replayed {result['replayed'][:16]}... (differing "
            f"parts: {', '.join(result.get('parts', [])) or '-'}){where}")
    if result["examples_match"] is False:
        say(f"jtrain: replay: the batch of step {fv.step} has other examples than recorded")
    print(json.dumps(result))
    return 0 if result["reproduced"] else EXIT_DIFFERENT


def main(argv=None) -> int:
    """`python -m jtrain.replay RUN --step S`."""
    return cli.run("python -m jtrain.replay", _define_flags, _main, argv,
                   description="Re-run a recorded step of a jtrain run and compare its "
                               "state hash.")


if __name__ == "__main__":
    sys.exit(main())
