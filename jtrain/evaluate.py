"""`python -m jtrain.evaluate` (= `jtrain evaluate`, jtrain.cli.evaluate). The library:
`evaluate_checkpoint` (jtrain.engine.checkpoint_eval) and the eval pass, `run_eval`
(jtrain.engine.evaluation), for runs of your own model."""

from __future__ import annotations

if __name__ == "__main__":
    from jtrain import cli as _cli

    _cli.module_main("evaluate")

from jtrain.engine.async_eval import follow  # noqa: E402,F401
from jtrain.engine.checkpoint_eval import (evaluate_checkpoint, read_jsonl,  # noqa: E402,F401
                                           resolve_step, write_report)
from jtrain.engine.evaluation import (Evaluation, evaluate_weights, format_line,  # noqa: E402,F401
                                      headline, make_spec, run_eval)

__all__ = ["evaluate_checkpoint", "main"]


def main(argv=None) -> int:
    """`jtrain evaluate ARGS` from Python: the exit code (after the one line of a failure).

    Examples:
        ```python
        import jtrain.evaluate

        code = jtrain.evaluate.main(["--workdir=runs/a", "--step=best"])
        ```
    """
    import sys

    from jtrain import cli

    return cli.run_command("evaluate", sys.argv[1:] if argv is None else argv)
