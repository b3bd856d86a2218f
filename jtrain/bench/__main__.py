"""`python -m jtrain.bench NAME` = `jtrain bench NAME`: the command is jtrain/cli/bench.py."""

from jtrain import cli

cli.module_main("bench")
