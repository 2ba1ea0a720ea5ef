"""Keeping the entries this worker owns, and giving them up.

An entry idle past the claim timeout is taken over by any worker (XAUTOCLAIM), so every in-flight
entry is renewed well inside that timeout (`renew`: XCLAIM to ourselves, idle 0, no delivery
counted). On shutdown, or when a request must start over, `hand_over` marks entries idle "forever"
so the next worker's XAUTOCLAIM takes them at once. Both go through the contract's fenced
`claim_own` step, which also tells which entries another worker owns now. Entries held for fair
share (read, not admitted yet) are renewed and handed over the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import redis.asyncio as aioredis

from producer_sdk.contract import keys, scripts, steps
from worker.service.inflight import Entry, EntryKey, InFlight, InFlightTable
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
        held: Callable[[], list[Entry]] = list,
        on_held_lost: Callable[[set[EntryKey]], None] = lambda keys: None,
    ) -> None:
        self.redis = redis
        self.inflight = inflight
        self.model, self.consumer = model, consumer
        self.group = keys.group(model)
        self.on_lost = on_lost
        self.held, self.on_held_lost = held, on_held_lost
        self.log = get_logger("pagedq.ownership", worker=consumer)

    async def renew(self) -> None:
        await self._claim_own(list(self.inflight.values()), 0)
        held = self.held()
        if held:
            lost = await self._claim_entries(held, 0)
            if lost:
                self.on_held_lost(lost)

    async def hand_over(self, recs: list[InFlight]) -> None:
        await self._claim_own(recs, scripts.HANDOVER_IDLE_MS)

    async def hand_over_entries(self, entries: list[Entry]) -> None:
        """Release entries this worker read but never admitted: the next worker's claim takes them."""
        await self._claim_entries(entries, scripts.HANDOVER_IDLE_MS)

    async def _claim_entries(self, entries: Sequence[Entry | InFlight], idle_ms: int) -> set[EntryKey]:
        """Claim these entries to ourselves with this idle time; those another worker owns now."""
        by_lane: dict[str, list[str]] = {}
        for e in entries:
            by_lane.setdefault(e.lane, []).append(e.entry_id)
        lost: set[EntryKey] = set()
        for lane, ids in by_lane.items():
            ks, args = scripts.claim_own_call(
                self.model, lane, group=self.group, consumer=self.consumer, idle_ms=idle_ms, entry_ids=ids
            )
            lost |= {(lane, i) for i in scripts.read_claim_own(await steps.CLAIM_OWN.run(self.redis, ks, args))}
        return lost

    async def _claim_own(self, recs: list[InFlight], idle_ms: int) -> None:
        if not recs:
            return
        lost = await self._claim_entries(recs, idle_ms)
        if lost:
            for rec in recs:
                # A request retired meanwhile (its final event acked the entry) is not lost.
                if rec.key in lost and rec.live and self.inflight.get(rec.request_id) is rec:
                    self.log.warning("entry owned by another worker now", request_id=rec.request_id)
                    self.on_lost(rec)
