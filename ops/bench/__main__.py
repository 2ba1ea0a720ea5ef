"""`python -m ops.bench COMMAND ...`: the benchmarks (ops/bench/cli.py); `pagedq bench` runs this."""

import sys

from ops.bench.cli import main

sys.exit(main())
