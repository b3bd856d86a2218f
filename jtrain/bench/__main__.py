"""`python -m jtrain.bench NAME`: see jtrain.bench.cli."""

from jtrain import boot

boot.start("bench")  # before the command's imports (jtrain.boot)

import sys  # noqa: E402

from jtrain.bench.cli import main  # noqa: E402

sys.exit(main())
