"""What docs/design.md counts is true of the code: the calls from the dispatcher to the
jitted step (rule 1), and build() reading top-down on one page."""

import ast
import inspect
import re
from pathlib import Path

from jtrain import cli
from jtrain.engine import assemble, parts

DESIGN = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
NUMBERS = {"Four": 4, "Five": 5, "Six": 6, "Seven": 7, "Eight": 8}


def test_the_calls_from_the_dispatcher_to_the_step_are_the_ones_the_design_names(
        tmp_path, monkeypatch, capsys):
    """A train command run in this process: the jtrain frames between `cli.run_command`
    and the jitted step are the chain rule 1 names, as many as it says."""
    rule = re.search(r"\*\*A short road to the loop\.\*\* (\w+) calls from the dispatcher "
                     r"to the jitted step:(.*?)\(counted by a test\)", DESIGN, re.S)
    assert rule, "docs/design.md rule 1 lost its counted chain"
    named = re.findall(r"`([\w.]+)`", rule.group(2))
    said = NUMBERS[rule.group(1)]
    seen = []
    made = parts.train_step_of

    def recording(*args, **kwargs):
        step = made(*args, **kwargs)

        def train_step(*a):
            if not seen:
                seen.extend(f"{f.frame.f_globals['__name__']}.{f.function}"
                            for f in inspect.stack()[1:]
                            if f.frame.f_globals.get("__name__", "").startswith("jtrain."))
            return step(*a)
        return train_step

    monkeypatch.setattr(parts, "train_step_of", recording)
    monkeypatch.chdir(tmp_path)
    code = cli.run_command("train", [
        f"--config={Path(__file__).resolve().parents[1] / 'configs' / 'base.py'}:debug",
        "--workdir=run", "--config.total_steps=1", "--config.model.num_layers=1",
        "--config.model.d_model=16", "--config.model.num_heads=2", "--config.model.d_ff=32",
        "--config.model.max_len=16", "--config.data.seq_len=16",
        "--config.data.batch_size=4", "--config.eval.num_batches=1"])
    capsys.readouterr()
    assert code == 0
    chain = list(reversed(seen))
    assert chain[0] == "jtrain.cli.run_command", chain
    # each name the page gives ends the qualified name of the frame at its place
    assert len(chain) == said == len(named) - 1, (chain, named)
    for frame, name in zip(chain, named, strict=False):
        assert frame.endswith(name.split(".")[-1]), (frame, name)
    assert named[-1] == "build.train_step"


def test_build_reads_top_down_without_a_set_up_object():
    """build() calls parts' helpers with named inputs; no object collects fields between
    them, and it fits on one page."""
    source = inspect.getsource(assemble.build)
    body = ast.parse(source).body[0]
    lines = len(source.splitlines()) - len(ast.get_docstring(body).splitlines())
    assert lines <= 60, lines
    assert "Setup" not in source and ".replace(" not in source
    assert not hasattr(parts, "Setup") and not hasattr(parts, "PARTS")
    called = {n.func.attr for n in ast.walk(body) if isinstance(n, ast.Call)
              and isinstance(n.func, ast.Attribute) and getattr(n.func.value, "id", "") == "parts"}
    assert {"model_object", "lora", "model_functions", "loss_of", "optimizer",
            "member_state", "population", "train_metrics", "memory_plan",
            "train_step_of", "eval_steps"} <= called, called
