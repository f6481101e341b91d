"""`python -m specdemo`: the command line (specdemo/cli)."""

import sys

from specdemo.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
