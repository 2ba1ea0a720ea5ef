"""Connection settings of every Redis client pagedq creates (SDK, worker, gateway).

Set explicitly, because redis-py's defaults changed between versions (6.x retries every command
three times and uses 5 s socket timeouts): a silent resend of a call that is not idempotent, or a
blocking read with no timeout on a half-open connection after a failover, must not depend on which
redis-py is installed. pagedq retries itself where retrying is safe (its writes are idempotent by
seq and by request id), so the client never does.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio.retry
import redis.retry
from redis.backoff import NoBackoff

KEEPALIVE_CHECK_S = 15  # redis-py PINGs a connection idle this long before using it again


def client_options(
    *, asyncio: bool, socket_timeout: float | None, connect_timeout: float | None = 5.0
) -> dict[str, Any]:
    """Keyword arguments for `Redis.from_url` (redis.asyncio's when `asyncio`). `socket_timeout` must
    exceed the longest BLOCK the client issues."""
    retry_class = redis.asyncio.retry.Retry if asyncio else redis.retry.Retry
    return {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": connect_timeout,
        "socket_keepalive": True,
        "health_check_interval": KEEPALIVE_CHECK_S,
        "retry": retry_class(NoBackoff(), 0),
        "retry_on_timeout": False,
        "decode_responses": False,
    }
