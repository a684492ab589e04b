"""`python -m pagoda ...`: the `pagoda` command (pagoda/entrypoints/cli.py)."""

import sys

from pagoda.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
