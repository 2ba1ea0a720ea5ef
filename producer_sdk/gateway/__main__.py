"""`python -m producer_sdk.gateway --redis-url URL [--host H] [--port P] [--api-keys FILE]`."""

import sys

from producer_sdk.gateway.server import main

sys.exit(main())
