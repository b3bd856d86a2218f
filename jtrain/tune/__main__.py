"""`python -m jtrain.tune` = `jtrain tune`: the command is jtrain/cli/tune.py."""

from jtrain import cli

cli.module_main("tune")
