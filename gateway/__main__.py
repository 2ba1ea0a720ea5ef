"""`python -m gateway --redis-url URL [--host H] [--port P] [--api-keys FILE]`."""

import sys

from gateway.server import main

sys.exit(main())
