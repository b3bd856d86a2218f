"""`python -m jtrain.recipes.report RUN [RUN ...]`: the stated result of recipe runs.

For one run whose model comes from a recipe module with a `report(params, config)`
(imputation), that report on the run's best checkpoint (by its checkpoint.monitor).
For every run, one line: its best and final value of checkpoint.monitor, the final eval
accuracy when there is one, and where it started from (init.path), so fine-tunes and
their from-scratch baseline read side by side.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

from jtrain import errors
from jtrain.checkpoint import export as export_lib
from jtrain.errors import WorkdirError
from jtrain.observe import trust


def load_run(workdir: str, step: str = "best") -> tuple[dict, dict]:
    """(config.json as a dict, params as a nested dict of numpy arrays) of a run's step."""
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{workdir}: no config.json (not a jtrain run)")
    with open(path) as f:
        config = json.load(f)
    leaves = export_lib.load_checkpoint_leaves(export_lib.find_step_dir(workdir, step))
    params: dict = {}
    for key, value in leaves.items():
        node = params
        *parents, name = key.split("/")[1:]  # drop "params"
        for part in parents:
            node = node.setdefault(part, {})
        node[name] = value
    return config, params


def summary_line(workdir: str) -> str:
    if not os.path.exists(os.path.join(workdir, "summary.json")):
        raise FileNotFoundError(f"{workdir}: no summary.json (not a finished jtrain run)")
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(workdir, "config.json")) as f:
        config = json.load(f)
    monitor = config["checkpoint"]["monitor"]
    parts = [f"{workdir}: step {summary.get('step')}"]
    if summary.get("best_value") is not None:
        parts.append(f"best {summary.get('best_metric') or monitor} "
                     f"{summary['best_value']:.4f} at step {summary.get('best_step')}")
    for key in ("eval/accuracy", "eval/f1_macro", "eval/loss"):
        if summary.get(key) is not None:
            parts.append(f"final {key} {summary[key]:.4f}")
    start = ((config.get("init") or {}).get("path")  # older runs: checkpoint.init_from
             or (config.get("checkpoint") or {}).get("init_from") or "scratch")
    parts.append(f"from {start}")
    if summary.get("stopped_by"):
        parts.append(f"stopped by {summary['stopped_by']}")
    return ", ".join(parts)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        print("usage: python -m jtrain.recipes.report RUN [RUN ...]", file=sys.stderr)
        return 2
    try:
        for workdir in argv:
            print(summary_line(workdir))
        if len(argv) == 1:
            config, params = None, None
            with open(os.path.join(argv[0], "config.json")) as f:
                recorded = json.load(f)
            factory = recorded["model"].get("factory", "")
            trust.check(argv[0], {"model": {"factory": factory}})  # before importing it
            module = importlib.import_module(factory.split(":")[0]) if factory else None
            if module is not None and hasattr(module, "report"):
                config, params = load_run(argv[0])
                module.report(params, config)
    except WorkdirError as e:
        print(errors.render(e), file=sys.stderr)
        return e.exit_code
    except (OSError, ValueError, KeyError, export_lib.ExportError) as e:
        print(f"jtrain: report error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
