"""Pulls request entries from the lane streams: reclaimed and new ones, in one place.

Each round takes only as many entries as the engine has room for, counted in sequences (a request
with n samples takes n seats): the number of entries read is the free seats over the mean n of the
requests seen so far (one entry until the first is seen; the rest of its burst is read once its n is
known), and nothing is read while fewer seats are free than that mean. So idle workers take the rest:
load balancing with no router.
Entries a dead worker left idle past the claim timeout come first (XAUTOCLAIM, every reclaim
interval), then new ones, high lane first; with nothing waiting it blocks on all lanes at once.
Redis outages and transient errors are retried with backoff; anything else stops the worker (the
supervisor's job).

Fair share (`window` > 0): each round also reads up to `window` entries beyond what it admits and
holds them in a `FairQueue`, then admits from what it holds: highest lane first, then the tenant
with the least weighted share so far. Held entries stay pending to this worker in the consumer group
(renewed with the in-flight ones, handed over on shutdown), so a crash loses none of them. With
`window` 0 entries are admitted in the order read (FIFO per lane).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from producer_sdk.contract import keys
from producer_sdk.contract.keys import ENTRY_DATA_FIELD
from producer_sdk.contract.redis_errors import is_transient
from producer_sdk.contract.replies import as_text
from producer_sdk.request_codec import decode_request
from worker.service.admission import Admission
from worker.service.fair_queue import FairQueue
from worker.service.inflight import Entry, EntryKey
from worker.service.logging import get_logger
from worker.service.metrics import WorkerMetrics
from worker.service.retry import Backoff
from worker.service.tenant_weights import TenantWeights

# One blocking read's slice. New entries end a read at once, so this only bounds how long a stopping worker
# waits for the read in flight (and costs an idle worker one XREADGROUP per slice).
INTAKE_BLOCK_MS = 250


class Intake:
    def __init__(
        self,
        redis: aioredis.Redis,
        blocking_redis: aioredis.Redis,
        admission: Admission,
        *,
        model: str,
        consumer: str,
        capacity: Callable[[], int],
        claim_idle_ms: int,
        reclaim_interval_s: float,
        metrics: WorkerMetrics,
        block_ms: int = INTAKE_BLOCK_MS,
        window: int = 0,
        low_lane_room: Callable[[], int] | None = None,
    ) -> None:
        self.redis, self.blocking = redis, blocking_redis
        self.admission = admission
        self.model, self.consumer = model, consumer
        self.group = keys.group(model)
        self.streams = {lane: keys.lane_stream(model, lane) for lane in keys.LANES}
        self.capacity = capacity
        # Entries the low lane may still add in flight (None: as many as there is room for): the rest of
        # the room stays for the other lanes, so a batch filling the queue never keeps them in Redis.
        self.low_lane_room = low_lane_room
        self.claim_idle_ms = claim_idle_ms
        self.reclaim_interval_s = reclaim_interval_s
        self.metrics = metrics
        self.block_ms = block_ms
        self.capacity_changed = asyncio.Event()
        self.stopping = False
        self._next_reclaim = 0.0
        self.window = max(0, window)
        self.fair = FairQueue(keys.LANES) if self.window else None
        self.weights = TenantWeights(redis)
        self._picked: list[Entry] = []  # popped from `fair`, being admitted
        self._gauged: set[tuple[str, str]] = set()
        self.log = get_logger("pagedq.intake", worker=consumer)

    async def ensure_groups(self) -> None:
        """Create the consumer group on every lane (from the stream's start: entries queued before
        any worker existed are served)."""
        for stream in self.streams.values():
            try:
                await self.redis.xgroup_create(stream, self.group, id="0", mkstream=True)
            except ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    def stop(self) -> None:
        """Stop pulling after the round under way (at most one blocking read, `block_ms`, away)."""
        self.stopping = True
        self.capacity_changed.set()

    async def run(self) -> None:
        backoff = Backoff(max_s=5.0)
        while not self.stopping:
            count = self._entries_to_read()
            if count <= 0:
                self.capacity_changed.clear()
                await self.capacity_changed.wait()
                continue
            try:
                await self._round(count)
                backoff.reset()
            except ResponseError as e:
                if "NOGROUP" in str(e):
                    self.log.warning("consumer group missing (Redis lost its data?): recreating")
                    await self._retry_later(backoff, e, self.ensure_groups)
                elif is_transient(e):
                    await self._retry_later(backoff, e)
                else:
                    raise
            except Exception as e:
                if not is_transient(e):
                    raise
                await self._retry_later(backoff, e)

    def _entries_to_read(self) -> int:
        room = self.capacity()
        mean = self.admission.mean_seats
        if mean is None:
            return min(room, 1)
        need = max(1, math.ceil(mean - 0.25))
        if room < need and not self.admission.idle():
            return 0  # an entry would likely not fit: leave it to a worker with room
        return max(1, room // need) if room > 0 else 0

    def _learned_seats(self, entries: list[Entry]) -> bool:
        """Whether these are the first entries the worker reads and one decodes: then the mean n is
        theirs (the admission decodes them again, strictly, and refuses the bad ones)."""
        if self.admission.mean_seats is not None or not entries:
            return False
        ns = []
        for e in entries:
            with contextlib.suppress(Exception):
                ns.append(decode_request(e.fields[ENTRY_DATA_FIELD.encode()], self.admission.limits).sampling.n)
        if ns:
            self.admission.mean_seats = sum(ns) / len(ns)
        return bool(ns)

    async def _retry_later(self, backoff: Backoff, error: BaseException, then=None) -> None:
        self.metrics.labels(self.metrics.redis_errors).inc()
        delay = backoff.next()
        self.log.warning("intake: redis unavailable", error=f"{type(error).__name__}: {error}", retry_in_s=delay)
        await asyncio.sleep(delay)
        if then is not None:
            try:
                await then()
            except Exception as e:
                if not is_transient(e):
                    raise

    async def _round(self, room: int) -> None:
        if time.monotonic() >= self._next_reclaim:
            self._next_reclaim = time.monotonic() + self.reclaim_interval_s
            # An entry we hold that the claim took back (its renewal came late) is ours already.
            reclaimed = [e for e in await self._reclaim(room) if not self.holds_entry(e.key)]
            if reclaimed:
                await self.admission.resume(reclaimed)
                return  # the room changed: measure it again
        if self.fair is None:
            entries = await self._read(room)
            if self._learned_seats(entries):  # the worker's first entry: the rest of its burst, now sized
                entries += await self._read(self._entries_to_read() - len(entries), block=False)
            if entries:
                await self.admission.admit(entries)
            return
        want = room + self.window - len(self.fair)
        if want > 0:
            got = await self._read(want, block=not self.fair)
            if self._learned_seats(got):  # the worker's first entry: the rest of its burst, now sized
                room = self._entries_to_read()
                got += await self._read(room + self.window - len(self.fair) - len(got), block=False)
            for e in got:
                self.fair.push(e)
        if self.fair:
            await self.weights.refresh(self.fair.tenants())
            self._picked = self.fair.pop_many(room, self.weights.get, self._lane_room())
            self._update_gauge()
            try:
                await self.admission.admit(self._picked)
            except Exception:
                self._picked = []  # pending here, not renewed: reclaimed after the idle timeout
                raise
            # (cancelled instead: `release_held` hands over the ones not admitted)
            self._picked = []

    # --- held entries (fair share) ----------------------------------------------------------------

    def holds_entry(self, key: EntryKey) -> bool:
        return self.fair is not None and self.fair.holds(key)

    def held_entries(self) -> list[Entry]:
        """What this worker holds and has not admitted: to renew along with the in-flight entries."""
        return self.fair.entries() if self.fair is not None else []

    def held_request_ids(self) -> list[str]:
        return [rid for e in self.held_entries() if (rid := e.request_id) is not None]

    async def cancel_held(self, request_id: str) -> None:
        """A held request was cancelled: admit it now, which answers it (abort) without compute."""
        e = self.fair.remove_request(request_id) if self.fair is not None else None
        if e is not None:
            self._update_gauge()
            await self.admission.admit([e])

    def drop_held(self, keys: set[EntryKey]) -> None:
        """Another worker owns these entries now: forget them."""
        gone = self.fair.remove_entries(keys) if self.fair is not None else []
        if gone:
            self.log.warning("held entries owned by another worker now", count=len(gone))
            self._update_gauge()

    def release_held(self, running: set[str]) -> list[Entry]:
        """Everything held and not admitted (the intake has stopped): for the handover. `running`:
        the request ids in flight (an entry being admitted when the intake stopped may be one)."""
        if self.fair is None:
            return []
        out = self.fair.drain() + [e for e in self._picked if e.request_id not in running]
        self._picked = []
        self._update_gauge()
        return out

    def _update_gauge(self) -> None:
        if self.fair is None:
            return
        m = self.metrics
        counts: dict[tuple[str, str], int] = {}
        for (lane, tenant), n in self.fair.held_by().items():
            key = (lane, m.tenant_label(tenant))
            counts[key] = counts.get(key, 0) + n
        for lane, label in self._gauged | set(counts):
            m.labels(m.fair_share_held, lane=lane, tenant=label).set(counts.get((lane, label), 0))
        self._gauged |= set(counts)

    async def _reclaim(self, room: int) -> list[Entry]:
        """Entries idle past the claim timeout (their worker died), as many as there is room for."""
        out: list[Entry] = []
        for lane, stream in self.streams.items():
            if len(out) >= room:
                break
            reply = await self.redis.xautoclaim(
                stream, self.group, self.consumer, self.claim_idle_ms, "0-0", count=room - len(out)
            )
            claimed, deleted = reply[1], reply[2] if len(reply) > 2 else []
            if deleted:  # entries deleted while pending (finished, then acked by nobody): clear them
                await self.redis.xack(stream, self.group, *deleted)
            if not claimed:
                continue
            ids = [as_text(entry_id) for entry_id, _ in claimed]
            counts = await self._deliveries(stream, ids)
            out += [
                Entry(lane, stream, eid, fields or {}, counts.get(eid, 1)) for eid, (_, fields) in zip(ids, claimed)
            ]
        return out

    async def _deliveries(self, stream: str, entry_ids: list[str]) -> dict[str, int]:
        pipe = self.redis.pipeline(transaction=False)
        for eid in entry_ids:
            pipe.xpending_range(stream, self.group, min=eid, max=eid, count=1)
        return {eid: int(info[0]["times_delivered"]) for eid, info in zip(entry_ids, await pipe.execute()) if info}

    async def _read(self, room: int, block: bool = True) -> list[Entry]:
        """Up to `room` new entries, high lane first; block on all lanes when none is waiting (unless
        told not to). The blocking read takes one entry; the rest of a burst that woke it is read at once
        after it, so that the burst is admitted together (its first engine step holds all of it)."""
        entries: list[Entry] = []
        limits = self._lane_room()
        open_streams = {s for lane, s in self.streams.items() if limits.get(lane, 1) > 0}
        for lane, stream in self.streams.items():
            count = min(room - len(entries), limits.get(lane, room))
            if count <= 0:
                continue
            got = await self.redis.xreadgroup(self.group, self.consumer, {stream: ">"}, count=count)
            entries += self._entries(got)
        if entries or not block:
            return entries
        got = await self.blocking.xreadgroup(
            self.group, self.consumer, {s: ">" for s in open_streams}, count=1, block=self.block_ms
        )
        entries = self._entries(got)
        if entries and room > 1:
            entries += await self._read(room - 1, block=False)
        return entries

    def _lane_room(self) -> dict[str, int]:
        """Per-lane limits on what may be read and admitted now (only the low lane has one)."""
        return {} if self.low_lane_room is None else {"low": self.low_lane_room()}

    def _entries(self, reply) -> list[Entry]:
        lane_of = {s: lane for lane, s in self.streams.items()}
        out = []
        for stream, items in reply or []:
            stream = as_text(stream)
            for entry_id, fields in items:
                out.append(Entry(lane_of[stream], stream, as_text(entry_id), fields or {}))
        return out
