"""`python -m jtrain.tune` = `jtrain tune`: the command is jtrain/tune/command.py."""

from jtrain import cli

cli.module_main("tune")
