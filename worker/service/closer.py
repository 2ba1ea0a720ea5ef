"""Ends request entries: a final event fenced on the request's lease, then the ack of its entry.

The two are separate contract steps (each in its own hash slot, for Redis Cluster), in this order:
an entry is acked only once its final event is stored, and both steps are idempotent, so a crash or
a lost reply between them leaves a pending entry whose next worker finds the final event and only
acks.

- `answer`: a final event and the ack (a request cancelled or past its deadline while queued).
- `refuse`: an `Error` event where the request can be addressed, a dead letter and the ack (an
  undecodable or invalid entry, a poison request, one delivered too often).
- `ack`: only the ack (a reclaimed request whose final event was already written).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable, Callable

import msgspec
import redis.asyncio as aioredis

from producer_sdk.contract import scripts, steps
from producer_sdk.contract.keys import ENTRY_DATA_FIELD
from producer_sdk.contract.scripts import DeadLetter
from producer_sdk.protocol import Error, Finished, encode_event
from worker.service.inflight import Entry
from worker.service.logging import get_logger
from worker.service.metrics import WorkerMetrics
from worker.service.retention import Retention
from worker.service.retry import retrying

PAYLOAD_HEAD_BYTES = 512  # what a dead letter keeps of the payload (with its length and SHA-1)


class EntryCloser:
    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        model: str,
        group: str,
        consumer: str,
        retention: Retention,
        dead_letter_ttl_ms: int,
        metrics: WorkerMetrics,
        release: Callable[[list[Entry]], Awaitable[object]],
    ) -> None:
        self.redis = redis
        self.release = release  # hands entries over to the next claim (Ownership.hand_over_entries)
        self.model, self.group, self.consumer = model, group, consumer
        self.retention, self.dead_letter_ttl_ms = retention, dead_letter_ttl_ms
        self.metrics = metrics
        self.log = get_logger("pagedq.intake", worker=consumer)

    async def answer(self, e: Entry, request_id: str, event: Finished) -> None:
        if not await self._final(e, request_id, event.seq, event, None):
            return
        self.metrics.labels(self.metrics.requests_finished, finished_reason=event.finish_reason).inc()
        self.metrics.tenant_finished(e.tenant, event.finish_reason)
        self.log.info(
            "answered without compute", request_id=request_id, finish_reason=event.finish_reason, tenant=e.tenant
        )

    async def ack(self, e: Entry, request_id: str, *, tokens: int = 0, dead_letter: DeadLetter | None = None) -> bool:
        """Ack (and delete) a finished request's entry; `tokens` go to its tenant's token window.
        Whether this call deleted the entry."""
        ks, args = scripts.ack_call(
            self.model,
            e.lane,
            request_id,
            group=self.group,
            entry_id=e.entry_id,
            result_ttl_ms=self.retention.ms(e.retention_ms),
            tenant=e.tenant,
            tokens=tokens,
            dead_letter=dead_letter,
        )
        return scripts.read_ack(await retrying(lambda: steps.ACK.run(self.redis, ks, args), self._on_retry))

    async def refuse(
        self, e: Entry, request_id: str | None, code: str, message: str, *, seq: int | None, attempt: int = 1
    ) -> None:
        """Dead-letter an entry; with `seq`, the request's stream also gets an Error event."""
        letter = self._letter(e, request_id, code, message)
        if request_id is not None and seq is not None:
            error = Error(seq=seq, attempt=attempt, code=code, message=message)
            if not await self._final(e, request_id, seq, error, letter):
                return
            self.metrics.labels(self.metrics.requests_failed, code=code).inc()
            self.metrics.tenant_finished(e.tenant, "error")
        else:
            ks, args = scripts.drop_call(
                self.model, e.lane, group=self.group, consumer=self.consumer, entry_id=e.entry_id, dead_letter=letter
            )
            await retrying(lambda: steps.DROP.run(self.redis, ks, args), self._on_retry)
        self.metrics.labels(self.metrics.dead_letters, code=code).inc()
        self.log.warning(
            "dead-lettered", request_id=request_id, code=code, reason=message, entry=e.entry_id, tenant=e.tenant
        )

    def _letter(self, e: Entry, request_id: str | None, code: str, message: str) -> DeadLetter:
        payload = e.fields.get(ENTRY_DATA_FIELD.encode(), b"")
        payload = payload if isinstance(payload, bytes) else bytes(payload)
        now_ms = int(time.time() * 1000)
        return DeadLetter(
            request_id=request_id or "",
            code=code,
            reason=message[:2000],
            lane=e.lane,
            entry_id=e.entry_id,
            worker=self.consumer,
            payload_head=payload[:PAYLOAD_HEAD_BYTES],
            payload_len=len(payload),
            payload_sha1=hashlib.sha1(payload).hexdigest(),
            min_id=f"{max(now_ms - self.dead_letter_ttl_ms, 0)}-0",
        )

    async def _final(
        self, e: Entry, request_id: str, first_seq: int, event: Finished | Error, letter: DeadLetter | None
    ) -> bool:
        """Write the final event under this delivery's lease, then ack; False when another attempt
        holds the lease or it is gone: nothing is written or acked here, and the entry is handed over
        (fenced on its ownership), so the next claim settles it at once (a newer entry's duplicate is
        dropped, a lost lease is taken again) instead of after the claim timeout."""
        retention_ms = self.retention.ms(e.retention_ms)
        ks, args = scripts.publish_call(
            request_id,
            owner=self.consumer,
            epoch=e.epoch,
            cap=0,
            live_ttl_ms=retention_ms,
            result_ttl_ms=retention_ms,
            first_seq=first_seq,
            events=[encode_event(event)],
            final=True,
        )
        reply = scripts.read_publish(await retrying(lambda: steps.PUBLISH.run(self.redis, ks, args), self._on_retry))
        if reply.status == "lost":
            self.log.warning("another attempt holds the request now", request_id=request_id, entry=e.entry_id)
            await retrying(lambda: self.release([e]), self._on_retry)
            return False
        if reply.status == "gap":
            # The stream ends before `first_seq` (it expired, or Redis lost writes in a failover): end
            # it where it ends, so its readers still see the request end.
            self.log.warning("response stream shorter than expected", request_id=request_id, last_seq=reply.last_seq)
            seq = reply.last_seq + 1
            return await self._final(e, request_id, seq, msgspec.structs.replace(event, seq=seq), letter)
        await self.ack(e, request_id, dead_letter=letter)
        return True

    def _on_retry(self, e: BaseException) -> None:
        self.metrics.labels(self.metrics.redis_errors).inc()
        self.log.warning("redis unavailable, retrying", error=f"{type(e).__name__}: {e}")
