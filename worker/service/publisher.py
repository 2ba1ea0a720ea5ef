"""Writes engine outputs to the response streams: one atomic round trip per flush.

The engine thread hands each step's outputs over (`put`, thread-safe through the event loop). A
flush takes everything queued since the last one, merges it per request (several steps' tokens in
one `Tokens` event per sample), and runs the PUBLISH script once: every request's events, and for
finished ones the final event plus XACK and XDEL of the request entry, all atomic and fenced on
ownership. While Redis is unreachable the batch is retried with backoff and the engine keeps
generating; what piles up meanwhile goes out merged in the next flush.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from producer_sdk import keys
from producer_sdk.protocol import Error, Finished, Started, Timings, Tokens, Usage, encode_event
from worker.engine.outputs import RequestOutput
from worker.service.inflight import InFlight, InFlightTable
from worker.service.logging import get_logger
from worker.service.metrics import WorkerMetrics
from worker.service.scripts import PUBLISH

REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)
# Fault injection for the chaos tests (off unless set).
_EXIT_BEFORE_FINAL = os.environ.get("PAGEDQ_FAULT_EXIT_BEFORE_FINAL_PUBLISH") == "1"


@dataclass
class _Pending:
    """One request's merged outputs since the last flush."""

    rec: InFlight
    tokens: dict[int, list[int]] = field(default_factory=dict)  # sample index -> new token ids
    text: dict[int, str] = field(default_factory=dict)
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    top_logprobs: dict[int, list] = field(default_factory=dict)
    final: RequestOutput | None = None


class Publisher:
    def __init__(
        self,
        redis: aioredis.Redis,
        inflight: InFlightTable,
        *,
        model: str,
        group: str,
        consumer: str,
        ttl_ms: int,
        metrics: WorkerMetrics,
        on_lost: Callable[[InFlight], None],
        on_done: Callable[[InFlight], None],
    ) -> None:
        self.redis = redis
        self.inflight = inflight
        self.model, self.group, self.consumer, self.ttl_ms = model, group, consumer, ttl_ms
        self.metrics = metrics
        self.on_lost, self.on_done = on_lost, on_done
        self._script = redis.register_script(PUBLISH)
        self._queue: asyncio.Queue[list[RequestOutput]] = asyncio.Queue()
        self._idle = asyncio.Event()
        self._idle.set()
        self.log = get_logger("pagedq.publisher", worker=consumer)

    def put(self, outputs: list[RequestOutput]) -> None:
        """Queue one engine step's outputs (call on the event loop thread)."""
        self._idle.clear()
        self._queue.put_nowait(outputs)

    async def wait_idle(self) -> None:
        """Until everything queued so far is written."""
        await self._idle.wait()

    async def run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            await self._flush(self._merge(batch))
            if self._queue.empty():
                self._idle.set()

    def _merge(self, batch: list[list[RequestOutput]]) -> list[_Pending]:
        merged: dict[str, _Pending] = {}
        for outputs in batch:
            for out in outputs:
                rec = self.inflight.get(out.request_id)
                if rec is None or rec.lost:
                    continue
                p = merged.setdefault(out.request_id, _Pending(rec))
                for c in out.outputs:
                    if c.delta_token_ids:
                        p.tokens.setdefault(c.index, []).extend(c.delta_token_ids)
                    if c.delta_text:
                        p.text[c.index] = p.text.get(c.index, "") + c.delta_text
                    if c.delta_logprobs is not None:
                        p.logprobs.setdefault(c.index, []).extend(c.delta_logprobs)
                        p.top_logprobs.setdefault(c.index, []).extend(c.delta_top_logprobs or [])
                if out.finished:
                    p.final = out
        return list(merged.values())

    def _events(self, p: _Pending) -> tuple[list[bytes], bool]:
        """Encoded events for one request, and whether they end it. Sequence numbers are only
        committed once the flush succeeded (`_commit`)."""
        rec, seq, events = p.rec, p.rec.next_seq, []
        if not rec.started:
            events.append(Started(seq=seq, worker=self.consumer, attempt=rec.attempt))
            seq += 1
        for index in sorted(set(p.tokens) | set(p.text)):
            lps = p.logprobs.get(index)
            events.append(
                Tokens(
                    seq=seq,
                    index=index,
                    token_ids=p.tokens.get(index, []),
                    text=p.text.get(index, ""),
                    logprobs=lps,
                    top_logprobs=p.top_logprobs.get(index) if lps is not None else None,
                )
            )
            seq += 1
        final = p.final is not None and rec.live
        if final:
            events.append(self._final_event(rec, p.final, seq))
        return [encode_event(e) for e in events], final

    @staticmethod
    def _final_event(rec: InFlight, out: RequestOutput, seq: int) -> Finished | Error:
        if out.error:
            return Error(seq=seq, code="engine_error", message=out.error)
        m = out.metrics
        ms = lambda s: None if s is None else round(s * 1000, 3)
        completion = sum(len(c.token_ids) for c in out.outputs)  # cumulative, resumed tokens included
        return Finished(
            seq=seq,
            finish_reason=out.outputs[0].finish_reason or "abort",
            finish_reasons=[c.finish_reason or "abort" for c in out.outputs],
            stop_reason=out.outputs[0].stop_reason,
            usage=Usage(
                prompt_tokens=len(out.prompt_token_ids),
                completion_tokens=completion,
                cached_tokens=m.num_cached_tokens,
            ),
            timings=Timings(queue_ms=ms(m.queue_time), ttft_ms=ms(m.ttft), e2e_ms=ms(m.e2e)),
        )

    async def _flush(self, pending: list[_Pending]) -> None:
        publish = []
        for p in pending:
            if p.rec.live or p.tokens:
                publish.append(p)
            elif p.final is not None:  # handed over, nothing left to write
                self._retire(p.rec)
        if not publish:
            return
        pending = publish
        keys_, args = [], [self.group, self.consumer, self.ttl_ms]
        built = []
        for p in pending:
            events, final = self._events(p)
            built.append((p, len(events), final))
            keys_ += [p.rec.stream, keys.response_stream(p.rec.request_id)]
            args += [p.rec.entry_id, p.rec.max_events, int(final), len(events), *events]
        if _EXIT_BEFORE_FINAL and any(final for _, _, final in built):
            os._exit(137)  # fault injection: die between the engine step and the final write
        lost = await self._call_with_retry(keys_, args)
        lost_set = {int(i) - 1 for i in lost}
        for i, (p, n_events, final) in enumerate(built):
            if i in lost_set:
                p.rec.lost = True
                self.on_lost(p.rec)
                continue
            self._commit(p, n_events, final)

    def _commit(self, p: _Pending, n_events: int, final: bool) -> None:
        rec = p.rec
        rec.next_seq += n_events
        rec.started = True
        for index, ids in p.tokens.items():
            while len(rec.delivered) <= index:
                rec.delivered.append([])
            rec.delivered[index].extend(ids)
        if p.final is not None:
            if final:
                self._record_finish(p.final)
            self._retire(rec)

    def _retire(self, rec: InFlight) -> None:
        self.inflight.pop(rec.request_id, None)
        self.on_done(rec)

    def _record_finish(self, out: RequestOutput) -> None:
        m, met = out.metrics, self.metrics
        if out.error:
            met.labels(met.requests_failed, code="engine_error").inc()
            return
        met.labels(met.requests_finished, finished_reason=out.outputs[0].finish_reason or "abort").inc()
        for hist, value in ((met.queue_time, m.queue_time), (met.ttft, m.ttft), (met.e2e, m.e2e)):
            if value is not None:
                met.labels(hist).observe(value)
        itl = met.labels(met.itl)
        for gap in m.inter_token_latencies:
            itl.observe(gap)

    async def _call_with_retry(self, keys_: list[str], args: list) -> list:
        delay = 0.05
        while True:
            try:
                return await self._script(keys=keys_, args=args)
            except REDIS_DOWN as e:
                self.metrics.labels(self.metrics.redis_errors).inc()
                self.log.warning("publish failed, retrying", error=str(e), retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
