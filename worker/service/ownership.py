"""Keeping the entries this worker owns, and giving them up.

An entry idle past the claim timeout is taken over by any worker (XAUTOCLAIM), so every in-flight
entry is renewed well inside that timeout (`renew`: XCLAIM to ourselves, idle 0, no delivery
counted). On shutdown, or when a request must start over, `hand_over` marks entries idle "forever"
so the next worker's XAUTOCLAIM takes them at once. Both go through the contract's fenced
`claim_own` step, which also tells which entries another worker owns now.
"""

from __future__ import annotations

from collections.abc import Callable

import redis.asyncio as aioredis

from producer_sdk.contract import keys, scripts
from worker.service.inflight import InFlight, InFlightTable
from worker.service.logging import get_logger


class Ownership:
    def __init__(
        self,
        redis: aioredis.Redis,
        inflight: InFlightTable,
        *,
        model: str,
        consumer: str,
        on_lost: Callable[[InFlight], None],
    ) -> None:
        self.redis = redis
        self.inflight = inflight
        self.model, self.consumer = model, consumer
        self.group = keys.group(model)
        self.on_lost = on_lost
        self._claim = redis.register_script(scripts.CLAIM_OWN)
        self.log = get_logger("pagedq.ownership", worker=consumer)

    async def renew(self) -> None:
        await self._claim_own(list(self.inflight.values()), 0)

    async def hand_over(self, recs: list[InFlight]) -> None:
        await self._claim_own(recs, scripts.HANDOVER_IDLE_MS)

    async def _claim_own(self, recs: list[InFlight], idle_ms: int) -> None:
        by_lane: dict[str, list[InFlight]] = {}
        for rec in recs:
            by_lane.setdefault(rec.lane, []).append(rec)
        for lane, group in by_lane.items():
            ks, args = scripts.claim_own_call(
                self.model,
                lane,
                group=self.group,
                consumer=self.consumer,
                idle_ms=idle_ms,
                entry_ids=[r.entry_id for r in group],
            )
            lost = scripts.read_claim_own(await self._claim(keys=ks, args=args))
            for rec in group:
                # A request retired meanwhile (its final event acked the entry) is not lost.
                if rec.entry_id in lost and rec.live and self.inflight.get(rec.request_id) is rec:
                    self.log.warning("entry owned by another worker now", request_id=rec.request_id)
                    self.on_lost(rec)
