"""Deprecated: the gateway is its own package now, `gateway` (`pip install 'pagedq[gateway]'`).

`producer_sdk.gateway` re-exports it for one release, with a DeprecationWarning: import from `gateway`
(`from gateway.app import create_app`) and run `pagedq gateway` or `python -m gateway`.
"""

import warnings

warnings.warn(
    "producer_sdk.gateway moved to the package `gateway` (from gateway.app import create_app; python -m gateway)",
    DeprecationWarning,
    stacklevel=2,
)

from gateway import app, server  # noqa: E402
from gateway.app import create_app  # noqa: E402
from gateway.server import main, run  # noqa: E402

__all__ = ["app", "create_app", "main", "run", "server"]
