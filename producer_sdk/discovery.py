"""Where a producer finds pagedq's Redis: `PAGEDQ_REDIS_URL`, else a running `pagedq up`, else localhost.

While `pagedq up` runs it keeps its URLs in `$PAGEDQ_CACHE/up.json` (default `~/.cache/pagedq/up.json`):
the Redis URL of its private redis-server (on a free port unless `--redis-port` names one) and the
gateway's base URL. The pagedq commands (`pagedq submit`, `stats`, `gateway`, ...) and the examples read
it through this module, which needs nothing beyond the standard library:

    from producer_sdk import Client
    from producer_sdk.discovery import default_redis_url

    with Client(default_redis_url()) as client:
        ...
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

STATE_FILE = "up.json"
LOCAL_REDIS_URL = "redis://127.0.0.1:6379/0"

REDIS_URL_HELP = (
    "redis://, rediss://, redis+sentinel:// or redis+cluster:// (default: PAGEDQ_REDIS_URL, a running "
    "`pagedq up`, localhost)"
)


def cache_dir() -> Path:
    """pagedq's cache folder: `PAGEDQ_CACHE`, default `~/.cache/pagedq`."""
    return Path(os.environ.get("PAGEDQ_CACHE", Path.home() / ".cache" / "pagedq"))


def state_path() -> Path:
    """The file a running `pagedq up` keeps its URLs in."""
    return cache_dir() / STATE_FILE


def running_stack() -> dict[str, Any] | None:
    """What a running `pagedq up` wrote (pid, redis_url, gateway_url, model), or None when none runs: no
    file, or the file of one that is gone (its process no longer exists)."""
    try:
        state = json.loads(state_path().read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict):
        return None
    try:
        os.kill(int(state.get("pid")), 0)
    except (OSError, TypeError, ValueError, OverflowError):
        return None
    return state


def discovered_redis_url() -> str | None:
    """The Redis URL of a running `pagedq up`, if one is running."""
    return (running_stack() or {}).get("redis_url")


def discovered_gateway_url() -> str | None:
    """The OpenAI-compatible base URL (`http://127.0.0.1:PORT/v1`) of a running `pagedq up`'s gateway, if
    one is running with a gateway."""
    return (running_stack() or {}).get("gateway_url")


def default_redis_url() -> str:
    """`PAGEDQ_REDIS_URL` if set, else a running `pagedq up`'s Redis, else redis://127.0.0.1:6379/0."""
    return os.environ.get("PAGEDQ_REDIS_URL") or discovered_redis_url() or LOCAL_REDIS_URL
