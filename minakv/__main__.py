"""`python -m minakv ...` runs the command line (see minakv/cli.py)."""

import sys

from minakv.cli import main

sys.exit(main())
