"""`--max-streams-per-key`: how many SSE streams one API key may hold open on this gateway process.

Counted in the process's memory, not in Redis: N gateways behind a balancer let a key hold up to N
times the limit, and a gateway that restarts starts from zero (docs/tenants.md, "Hostile clients").
Requests without a key (a gateway without `--api-keys`) are not limited here: with no key to tell
clients apart, a per-key cap would only cap the whole gateway's streams (at 64 by default, too few for
`pagedq up` serving an agent fleet); `--limit-concurrency` bounds those connections.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from gateway import errors
from gateway.metrics import GatewayMetrics

ANONYMOUS_KEY = ""  # the key of every request when the gateway has no --api-keys (counted, never capped)


class Slot:
    """One open stream of a key; `release()` gives it back (once, however often it is called)."""

    def __init__(self, owner: StreamLimit, key: str) -> None:
        self.owner, self.key = owner, key
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.owner._release(self.key)


class StreamLimit:
    def __init__(self, limit: int, metrics: GatewayMetrics, retry_after_s: int) -> None:
        self.limit = limit  # 0: none
        self.metrics = metrics
        self.retry_after_s = retry_after_s
        self.open: dict[str, int] = {}  # key id -> streams open (absent: none)

    def acquire(self, key: str | None) -> Slot:
        """A slot for one more stream of `key`, or the 429 too_many_streams."""
        key = key or ANONYMOUS_KEY
        n = self.open.get(key, 0)
        if self.limit and n >= self.limit and key != ANONYMOUS_KEY:
            self.metrics.streams_refused.inc()
            raise errors.too_many_streams(self.limit, self.retry_after_s)
        self.open[key] = n + 1
        return Slot(self, key)

    def _release(self, key: str) -> None:
        n = self.open.get(key, 0) - 1
        if n > 0:
            self.open[key] = n
        else:
            self.open.pop(key, None)

    @contextlib.contextmanager
    def reserve(self, key: str | None, wanted: bool = True) -> Iterator[Slot | None]:
        """A slot (None unless `wanted`) held for the stream that the block returns: given back if the
        block raises; else the stream gives it back when it ends (`EventStream(slot=...)`)."""
        slot = self.acquire(key) if wanted else None
        try:
            yield slot
        except BaseException:
            if slot is not None:
                slot.release()
            raise
