"""Deprecated: `python -m producer_sdk.gateway` runs `python -m gateway` (see the package's docstring)."""

import sys

from producer_sdk.gateway import main

MOVED = "producer_sdk.gateway moved to the package `gateway`: run `python -m gateway` or `pagedq gateway`"
print(MOVED, file=sys.stderr)
sys.exit(main())
