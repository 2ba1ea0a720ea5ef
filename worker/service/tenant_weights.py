"""Tenants' fair-share weights, read from Redis now and then, not per request.

`refresh` reads the weights of the tenants it is given when the cache is older than `ttl_s` or one of
them was never read (one pipelined HGET each); `get` answers from the cache (1 for a tenant never
read). A change made with `pagedq tenant set T --weight W` is seen within `ttl_s`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import redis.asyncio as aioredis

from producer_sdk.contract import keys
from producer_sdk.tenants import DEFAULT_WEIGHT, WEIGHT_FIELD, parse_weight

WEIGHTS_TTL_S = 5.0
MAX_CACHED = 10_000  # tenants; beyond it the cache starts over


class TenantWeights:
    def __init__(self, redis: aioredis.Redis, ttl_s: float = WEIGHTS_TTL_S) -> None:
        self.redis = redis
        self.ttl_s = ttl_s
        self._weights: dict[str, float] = {}
        self._read_at = float("-inf")

    def get(self, tenant: str) -> float:
        return self._weights.get(tenant, DEFAULT_WEIGHT)

    async def refresh(self, tenants: Iterable[str]) -> None:
        tenants = list(tenants)
        stale = time.monotonic() - self._read_at >= self.ttl_s
        wanted = tenants if stale else [t for t in tenants if t not in self._weights]
        if not wanted:
            return
        pipe = self.redis.pipeline(transaction=False)
        for tenant in wanted:
            pipe.hget(keys.tenant_quota(tenant), WEIGHT_FIELD)
        values = await pipe.execute()
        if stale:  # forget everything: a tenant not waiting now is read again when it comes back
            self._read_at = time.monotonic()
            self._weights.clear()
        elif len(self._weights) > MAX_CACHED:
            self._weights.clear()
        self._weights.update({t: parse_weight(v) for t, v in zip(wanted, values, strict=True)})
