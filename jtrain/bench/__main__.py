"""`python -m jtrain.bench NAME`: see jtrain.bench.cli."""

import sys

from jtrain.bench.cli import main

sys.exit(main())
