"""`python -m jtrain.tune`: see jtrain.tune."""

from jtrain import boot

boot.start("tune")  # before the command's imports (jtrain.boot)

import sys  # noqa: E402

from jtrain.tune import main  # noqa: E402

sys.exit(main())
