"""`python -m sd_accel`: the command line (accel/cli/main.py)."""

import sys

from .accel.cli.main import main

sys.exit(main())
