"""Retrying Redis calls through transient failures, with jittered exponential backoff."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

from producer_sdk.contract.redis_errors import CONNECTION_ERRORS, is_transient

T = TypeVar("T")
REDIS_DOWN = CONNECTION_ERRORS


class Backoff:
    """Exponential backoff with full jitter, so retries do not stampede a recovering Redis."""

    def __init__(self, base_s: float = 0.05, max_s: float = 2.0) -> None:
        self.base_s, self.max_s, self.failures = base_s, max_s, 0

    def next(self) -> float:
        self.failures += 1
        return random.uniform(self.base_s / 2, min(self.max_s, self.base_s * 2**self.failures))

    def reset(self) -> None:
        self.failures = 0


async def retrying(call: Callable[[], Awaitable[T]], on_retry: Callable[[BaseException], None]) -> T:
    """`call()` until it succeeds or fails for good: transient errors (`is_transient`) are retried
    forever with backoff (each reported to `on_retry`), anything else is raised."""
    backoff = Backoff()
    while True:
        try:
            return await call()
        except Exception as e:
            if not is_transient(e):
                raise
            on_retry(e)
        await asyncio.sleep(backoff.next())
