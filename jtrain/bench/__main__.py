"""`python -m jtrain.bench NAME` = `jtrain bench NAME`: the command is jtrain/bench/command.py."""

from jtrain import cli

cli.module_main("bench")
