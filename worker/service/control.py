"""The worker's background duties: cancels, ownership renewal, reclaiming dead workers' entries,
heartbeats with load, gauges, and a periodic one-line summary."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from producer_sdk.contract import keys
from producer_sdk.contract.scripts import CLAIM_OWN
from producer_sdk.errors import ProtocolError
from producer_sdk.protocol import decode_control
from worker.engine.engine import LLMEngine
from worker.service.inflight import Entry, InFlight, InFlightTable
from worker.service.intake import Intake
from worker.service.logging import get_logger
from worker.service.metrics import WorkerMetrics
from worker.service.retry import REDIS_DOWN

HANDOVER_IDLE_MS = 10**12  # "idle forever": the next XAUTOCLAIM of any worker takes the entry


async def every(interval: float, fn: Callable[[], Awaitable[None]], log, what: str) -> None:
    """Run `fn` every `interval` seconds forever. Redis outages are logged and retried; so is anything
    else (logged with its traceback): a background duty must not die quietly."""
    while True:
        try:
            await fn()
        except REDIS_DOWN as e:
            log.warning(f"{what}: redis unavailable", error=str(e))
        except ResponseError as e:
            log.warning(f"{what}: redis error", error=str(e))
        except Exception:
            log.exception(f"{what} failed; retrying")
        await asyncio.sleep(interval)


class Control:
    def __init__(
        self,
        redis: aioredis.Redis,
        engine: LLMEngine,
        inflight: InFlightTable,
        intake: Intake,
        *,
        model: str,
        consumer: str,
        metrics: WorkerMetrics,
        claim_idle_ms: int,
        max_deliveries: int,
        heartbeat_interval_s: float,
        capacity: Callable[[], int],
        on_lost: Callable[[str], None],
    ) -> None:
        self.redis = redis
        self.engine = engine
        self.inflight = inflight
        self.intake = intake
        self.model, self.consumer = model, consumer
        self.group = keys.group(model)
        self.metrics = metrics
        self.claim_idle_ms = claim_idle_ms
        self.max_deliveries = max_deliveries
        self.heartbeat_interval_s = heartbeat_interval_s
        self.capacity = capacity
        self.on_lost = on_lost
        self._claim = redis.register_script(CLAIM_OWN)
        self.recent_cancels: OrderedDict[str, None] = OrderedDict()
        self.started_ms = int(time.time() * 1000)
        self.log = get_logger("pagedq.control", worker=consumer)
        self._last_stats = (time.monotonic(), 0, 0, 0, 0)

    # --- cancel -------------------------------------------------------------------------------

    async def listen_for_cancels(self) -> None:
        """Control channel messages; pub/sub drops messages while disconnected, so `sweep_cancels`
        also checks the cancel flags of everything in flight now and then."""
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(keys.control_channel(self.model))
                await self.sweep_cancels()
                async for message in pubsub.listen():
                    self._on_control(message.get("data"))
            except REDIS_DOWN as e:
                self.log.warning("control channel lost, resubscribing", error=str(e))
                await asyncio.sleep(0.5)
            finally:
                await pubsub.aclose()

    def _on_control(self, data) -> None:
        try:
            msg = decode_control(data)
        except ProtocolError:
            return
        if msg.type != "cancel" or not msg.request_id:
            return
        # Remembered for a while: the request may be between intake's flag check and the engine.
        self.recent_cancels[msg.request_id] = None
        while len(self.recent_cancels) > 10_000:
            self.recent_cancels.popitem(last=False)
        if msg.request_id in self.inflight:
            self.log.info("cancel", request_id=msg.request_id)
            self.engine.abort_request(msg.request_id)

    def recently_cancelled(self, request_id: str) -> bool:
        return request_id in self.recent_cancels

    async def sweep_cancels(self) -> None:
        ids = list(self.inflight)
        if not ids:
            return
        pipe = self.redis.pipeline(transaction=False)
        for rid in ids:
            pipe.exists(keys.cancel_flag(rid))
        for rid, flagged in zip(ids, await pipe.execute(), strict=True):
            if flagged and rid in self.inflight:
                self.engine.abort_request(rid)

    # --- ownership ----------------------------------------------------------------------------

    async def renew(self, idle_ms: int = 0, recs: list[InFlight] | None = None) -> None:
        """Reset the idle time of our in-flight entries (or set it huge, to hand `recs` over)."""
        recs = list(self.inflight.values()) if recs is None else recs
        by_stream: dict[str, list[str]] = {}
        for rec in recs:
            by_stream.setdefault(rec.stream, []).append(rec.entry_id)
        for stream, entry_ids in by_stream.items():
            lost = await self._claim(keys=[stream], args=[self.group, self.consumer, idle_ms, *entry_ids])
            lost_ids = {x.decode() if isinstance(x, bytes) else x for x in lost}
            for rec in recs:
                if rec.stream == stream and rec.entry_id in lost_ids and rec.live:
                    self.log.warning("entry owned by another worker now", request_id=rec.request_id)
                    self.on_lost(rec.request_id)

    async def reclaim(self) -> None:
        """Take over entries idle past the timeout (their worker died), as many as we have room for."""
        room = self.capacity()
        for lane, stream in self.intake.streams.items():
            if room <= 0:
                return
            try:
                reply = await self.redis.xautoclaim(
                    stream, self.group, self.consumer, self.claim_idle_ms, "0-0", count=room
                )
            except ResponseError as e:
                if "NOGROUP" in str(e):
                    await self.intake.ensure_groups()
                    continue
                raise
            claimed, deleted = reply[1], reply[2] if len(reply) > 2 else []
            if deleted:  # entries deleted while pending (finished, then acked by nobody): clear them
                await self.redis.xack(stream, self.group, *deleted)
            entries = []
            for entry_id, fields in claimed:
                eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                entries.append(Entry(lane, stream, eid, fields or {}, deliveries=await self._deliveries(stream, eid)))
            if entries:
                room -= len(entries)
                await self.intake.admit_reclaimed(entries, self.max_deliveries)

    async def _deliveries(self, stream: str, entry_id: str) -> int:
        info = await self.redis.xpending_range(stream, self.group, min=entry_id, max=entry_id, count=1)
        return int(info[0]["times_delivered"]) if info else 1

    # --- heartbeat, gauges, summary -----------------------------------------------------------

    async def heartbeat(self) -> None:
        eng, kv = self.engine, self.engine.kv
        now = time.monotonic()
        t0, gen0, prompt0, _, _ = self._last_stats
        gen, prompt = eng.stats.generation_tokens, eng.stats.prompt_tokens
        dt = max(now - t0, 1e-6)
        self._last_stats = (now, gen, prompt, 0, 0)
        running, waiting = len(eng.scheduler.running), len(eng.scheduler.waiting)
        state = {
            "worker": self.consumer,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "model": self.model,
            "started_ms": self.started_ms,
            "ts_ms": int(time.time() * 1000),
            "running": running,
            "waiting": waiting,
            "max_num_seqs": eng.scheduler_config.max_num_seqs,
            "kv_usage": round(kv.usage, 4),
            "gen_tokens_per_s": round((gen - gen0) / dt, 2),
            "prompt_tokens_per_s": round((prompt - prompt0) / dt, 2),
            "requests_finished": sum(eng.stats.finished.values()),
        }
        ttl_ms = int(self.heartbeat_interval_s * 3000)
        pipe = self.redis.pipeline(transaction=True)
        pipe.zadd(keys.heartbeats(self.model), {self.consumer: state["ts_ms"]})
        pipe.set(keys.worker_state(self.model, self.consumer), json.dumps(state), px=ttl_ms)
        for stream in self.intake.streams.values():
            pipe.xlen(stream)
        replies = await pipe.execute()
        m = self.metrics
        for lane, length in zip(self.intake.streams, replies[2:], strict=True):
            m.labels(m.queue_length, lane=lane).set(length)
        self.state = state

    def summary(self, stats) -> None:
        """The periodic one-line summary (`stats`: the engine thread's latest KVCacheStats)."""
        eng = self.engine
        state = getattr(self, "state", None) or {}
        hit = stats.prefix_hits_tokens / stats.prefix_queries_tokens if stats.prefix_queries_tokens else 0.0
        self.log.info(
            "engine",
            gen_tok_s=state.get("gen_tokens_per_s", 0.0),
            prompt_tok_s=state.get("prompt_tokens_per_s", 0.0),
            running=len(eng.scheduler.running),
            waiting=len(eng.scheduler.waiting),
            in_flight=len(self.inflight),
            kv_usage=f"{stats.usage:.1%}",
            prefix_hit_rate=f"{hit:.1%}",
            preemptions=eng.stats.num_preemptions,
        )
