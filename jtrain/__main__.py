"""`python -m jtrain CMD ...` = `jtrain CMD ...` (jtrain.cli)."""

from jtrain import cli

cli.run()
