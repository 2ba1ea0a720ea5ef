"""Heartbeats with load, queue-length gauges, and the periodic one-line summary.

The heartbeat is how producers (and `pagedq stats`) see live workers: a sorted set of last beats
and, per worker, a JSON `WorkerState` that expires a few beats after the worker stops. Everything
about the engine comes from its snapshot, built on the engine thread.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable

import redis.asyncio as aioredis

from producer_sdk.contract import keys
from worker.engine.engine import LLMEngine
from worker.service.logging import get_logger
from worker.service.metrics import WorkerMetrics

# Fault injection for the chaos tests (off unless set): once this file exists, the heartbeat duty
# raises, as a bug in a background task would.
_CRASH_FILE = os.environ.get("PAGEDQ_FAULT_HEARTBEAT_CRASH_FILE")


MODEL_RETENTION_MS = 7 * 86400 * 1000  # a model name no worker served for a week is forgotten


class Heartbeat:
    def __init__(
        self,
        redis: aioredis.Redis,
        engine: LLMEngine,
        *,
        model: str,
        consumer: str,
        interval_s: float,
        max_queue_len: int | None,
        metrics: WorkerMetrics,
        in_flight: Callable[[], int],
        draining: Callable[[], bool],
    ) -> None:
        self.redis = redis
        self.engine = engine
        self.model, self.consumer = model, consumer
        self.interval_s = interval_s
        self.max_queue_len = max_queue_len
        self.metrics = metrics
        self.in_flight = in_flight
        self.draining = draining
        self.started_ms = int(time.time() * 1000)
        self.last_ok: float | None = None  # time.monotonic() of the last beat Redis took
        self.state: dict = {}
        self._rates = (time.monotonic(), 0, 0)
        self.log = get_logger("pagedq.worker", worker=consumer, model=model)

    async def publish_config(self) -> None:
        """The limits producers read before submitting (max_queue_len, max_model_len)."""
        lim = self.engine.limits
        cfg = {"max_model_len": lim.max_model_len, "block_size": lim.block_size}
        if self.max_queue_len:
            cfg["max_queue_len"] = self.max_queue_len
        await self.redis.hset(keys.config(self.model), mapping=cfg)

    async def beat(self) -> None:
        if _CRASH_FILE and os.path.exists(_CRASH_FILE):
            raise RuntimeError("fault injection: the heartbeat fails")
        snap, lim = self.engine.snapshot(), self.engine.limits
        now = time.monotonic()
        t0, gen0, prompt0 = self._rates
        dt = max(now - t0, 1e-6)
        self._rates = (now, snap.generation_tokens, snap.prompt_tokens)
        state = {
            "worker": self.consumer,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "model": self.model,
            "started_ms": self.started_ms,
            "ts_ms": int(time.time() * 1000),
            "running": snap.running,
            "waiting": snap.waiting,
            "max_num_seqs": lim.max_num_seqs,
            "max_model_len": lim.max_model_len,
            "kv_usage": round(snap.kv_usage, 4),
            "gen_tokens_per_s": round((snap.generation_tokens - gen0) / dt, 2),
            "prompt_tokens_per_s": round((snap.prompt_tokens - prompt0) / dt, 2),
            "requests_finished": sum(count for _, count in _items(snap.finished)),
            "draining": self.draining(),
        }
        # Not a transaction: the registry and the model's keys live in different hash slots (Cluster).
        # Readers tolerate the order: a heartbeat without its state yet is not pruned for a while.
        pipe = self.redis.pipeline(transaction=False)
        pipe.zadd(keys.heartbeats(self.model), {self.consumer: state["ts_ms"]})
        pipe.zadd(keys.models(), {self.model: state["ts_ms"]})
        pipe.zremrangebyscore(keys.models(), "-inf", state["ts_ms"] - MODEL_RETENTION_MS)
        pipe.set(keys.worker_state(self.model, self.consumer), json.dumps(state), px=int(self.interval_s * 3000))
        if self.max_queue_len:
            pipe.hset(keys.config(self.model), "max_queue_len", self.max_queue_len)
        for stream in (keys.lane_stream(self.model, lane) for lane in keys.LANES):
            pipe.xlen(stream)
        replies = await pipe.execute()
        m = self.metrics
        for lane, length in zip(keys.LANES, replies[-len(keys.LANES) :], strict=True):
            m.labels(m.queue_length, lane=lane).set(length)
        await self._backlog()
        self.state = state
        self.last_ok = time.monotonic()

    async def _backlog(self) -> None:
        """The autoscaling signal: per lane, entries no worker has taken yet and how long the oldest
        of them has waited (from its stream id, which is its enqueue time in ms)."""
        lanes = [keys.lane_stream(self.model, lane) for lane in keys.LANES]
        pipe = self.redis.pipeline(transaction=False)
        for stream in lanes:
            pipe.xinfo_groups(stream)
        groups = await pipe.execute(raise_on_error=False)
        group = keys.group(self.model).encode()
        waiting = []
        for stream, info in zip(lanes, groups, strict=True):
            mine = next((g for g in info if g.get("name") == group), None) if isinstance(info, list) else None
            waiting.append((stream, mine))
        pipe = self.redis.pipeline(transaction=False)
        for stream, g in waiting:
            after = g["last-delivered-id"] if g else b"0-0"
            pipe.xrange(stream, min=b"(" + _b(after), count=1)
        firsts = await pipe.execute(raise_on_error=False)
        now_ms = time.time() * 1000
        m = self.metrics
        for lane, (_, g), first in zip(keys.LANES, waiting, firsts, strict=True):
            lag = g.get("lag") if g else None
            m.labels(m.queue_lag, lane=lane).set(lag if isinstance(lag, int) else 0)
            oldest = 0.0
            if isinstance(first, list) and first:
                oldest = max(0.0, (now_ms - int(_b(first[0][0]).split(b"-")[0])) / 1000)
            m.labels(m.queue_oldest_age, lane=lane).set(oldest)

    async def leave(self) -> None:
        await self.redis.zrem(keys.heartbeats(self.model), self.consumer)
        await self.redis.delete(keys.worker_state(self.model, self.consumer))

    async def summary(self) -> None:
        snap = self.engine.snapshot()
        hit = snap.prefix_hits_tokens / snap.prefix_queries_tokens if snap.prefix_queries_tokens else 0.0
        self.log.info(
            "engine",
            gen_tok_s=self.state.get("gen_tokens_per_s", 0.0),
            prompt_tok_s=self.state.get("prompt_tokens_per_s", 0.0),
            running=snap.running,
            waiting=snap.waiting,
            in_flight=self.in_flight(),
            kv_usage=f"{snap.kv_usage:.1%}",
            prefix_hit_rate=f"{hit:.1%}",
            preemptions=snap.num_preemptions,
        )


def _b(x) -> bytes:
    return x if isinstance(x, bytes) else str(x).encode()


def _items(finished):
    return finished.items() if hasattr(finished, "items") else finished
