"""`python -m jtrain.tune`: see jtrain.tune."""

import sys

from jtrain.tune import main

if __name__ == "__main__":
    sys.exit(main())
