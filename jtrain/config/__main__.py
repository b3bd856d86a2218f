"""`python -m jtrain.config --markdown > docs/reference/config.md`: the reference of every config
key (jtrain.config.reference.markdown); without --markdown, the same as plain text of
the defaults (`--model=mlp` for another model family)."""

import argparse
import sys

from jtrain.config import reference


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jtrain.config",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="docs/reference/config.md's text")
    parser.add_argument("--model", default="transformer", help="model family (plain text)")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(reference.markdown())
    else:
        sys.stdout.write(reference.resolved_text({"model": {"name": args.model}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
