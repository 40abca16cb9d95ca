"""`python -m benchmarks KIND ...`: the harness's command line (benchmarks/cli.py)."""

import sys

from benchmarks.cli import main

sys.exit(main())
