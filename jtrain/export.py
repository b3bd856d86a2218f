"""`python -m jtrain.export WORKDIR --out=DIR`: the command lives in jtrain.checkpoint.export."""

import sys

from jtrain.checkpoint.export import main

if __name__ == "__main__":
    sys.exit(main())
