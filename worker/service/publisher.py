"""Writes engine outputs to the response streams: one pipelined round trip per flush.

The engine thread hands each step's outputs over (`put`, thread-safe through the event loop). A
flush takes everything queued since the last one, merges it per request (several steps' tokens in
one `Tokens` event per sample), and runs the contract's `publish` step once per request, all in one
pipeline, each fenced on the request's lease and idempotent by seq. So a call whose reply was lost
can be sent again as it is: Redis skips what it already holds. Requests whose final event is then
stored get their entries acked (the `ack` step, idempotent too) in a second pipelined round trip;
until that succeeds they stay in flight (and renewed). With --wait-replicas, the final events are
on that many replicas (WAIT, on each node written) before any of their entries is acked.

Failures are handled per request: transient ones (Redis down, OOM, READONLY, BUSY, ...) are retried
with jittered backoff while the engine keeps generating (what piles up goes out merged); a request
whose call fails for good (a key of the wrong type, ...) is ended on its own (`on_failed`).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from producer_sdk.chat import ToolCallDelta
from producer_sdk.contract import scripts, steps
from producer_sdk.contract.cluster import node_of, queue_wait
from producer_sdk.contract.redis_errors import is_connection_error, is_transient
from producer_sdk.protocol import Error, Finished, Started, Timings, Tokens, ToolCalls, Usage, encode_event
from worker.engine.outputs import RequestOutput
from worker.service.finished import record_finish
from worker.service.inflight import InFlight, InFlightTable
from worker.service.logging import get_logger
from worker.service.metrics import WorkerMetrics
from worker.service.retention import Retention
from worker.service.retry import Backoff
from worker.service.tracing import RequestTracer

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
    # sample index -> [token texts, token bytes, top texts, top bytes] (with logprobs)
    texts: dict[int, tuple[list, list, list, list]] = field(default_factory=dict)
    content: dict[int, str] = field(default_factory=dict)  # requests with tools: text without markup
    tool_calls: dict[int, list[ToolCallDelta]] = field(default_factory=dict)
    final: RequestOutput | None = None


@dataclass
class _Call:
    """One `publish` (or, `ack` set, `ack`) call of a flush, until Redis has answered it for good."""

    pending: _Pending
    n_events: int
    final: bool
    keys: list[str]
    args: list
    ack: bool = False


@dataclass
class PublisherHooks:
    """What the service does when a request's publish does not simply succeed."""

    on_done: Callable[[InFlight], None]  # finished and retired
    on_lost: Callable[[InFlight], None]  # another attempt holds its lease now (or the lease is gone)
    on_gap: Callable[[InFlight, int], None]  # its stream lost events (last seq stored given)
    on_failed: Callable[[InFlight, BaseException], None]  # Redis refuses its writes for good


class Publisher:
    def __init__(
        self,
        redis: aioredis.Redis,
        inflight: InFlightTable,
        hooks: PublisherHooks,
        *,
        model: str,
        group: str,
        consumer: str,
        live_ttl_ms: int,
        retention: Retention,
        metrics: WorkerMetrics,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
        tracer: RequestTracer | None = None,
        stream_interval: int = 1,
    ) -> None:
        self.redis = redis
        self.inflight = inflight
        self.hooks = hooks
        self.model, self.group, self.consumer = model, group, consumer
        self.live_ttl_ms, self.retention = live_ttl_ms, retention
        self.metrics = metrics
        self.wait_replicas, self.wait_timeout_ms = wait_replicas, wait_timeout_ms
        self.tracer = tracer
        self.stream_interval = max(1, stream_interval)
        self._held: dict[str, _Pending] = {}  # merged outputs not yet due (--stream-interval)
        self._flush_held = False
        self._queue: asyncio.Queue[list[RequestOutput]] = asyncio.Queue()
        self._idle = asyncio.Event()
        self._idle.set()
        self.log = get_logger("pagedq.publisher", worker=consumer)

    def put(self, outputs: list[RequestOutput]) -> None:
        """Queue one engine step's outputs (call on the event loop thread)."""
        self._idle.clear()
        self._queue.put_nowait(outputs)

    async def wait_idle(self) -> None:
        """Until everything queued so far is written, tokens held back by --stream-interval included."""
        if self._held:
            self._flush_held = True
            self.put([])
        await self._idle.wait()

    async def run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            self._merge(batch)
            await self._flush(self._due())
            if self._queue.empty():
                self._idle.set()

    # --- building the calls --------------------------------------------------------------------

    def _merge(self, batch: list[list[RequestOutput]]) -> None:
        """Merge the steps' outputs per request into what is held since the last write."""
        merged = self._held
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
                    if c.delta_token_texts is not None:
                        got = p.texts.setdefault(c.index, ([], [], [], []))
                        got[0].extend(c.delta_token_texts)
                        got[1].extend(c.delta_token_bytes or [])
                        got[2].extend(c.delta_top_token_texts or [])
                        got[3].extend(c.delta_top_token_bytes or [])
                    if c.delta_content is not None:
                        p.content[c.index] = p.content.get(c.index, "") + c.delta_content
                    if c.delta_tool_calls:
                        p.tool_calls.setdefault(c.index, []).extend(c.delta_tool_calls)
                if out.finished:
                    p.final = out

    def _due(self) -> list[_Pending]:
        """What goes out now: a request's first event, its final one, any with --stream-interval new tokens
        in a sample, or everything when `wait_idle` asks. The rest stays held (merged with later steps)."""
        force, self._flush_held = self._flush_held, False
        due = []
        for rid, p in list(self._held.items()):
            if p.rec.lost or self.inflight.get(rid) is not p.rec:  # lost or ended meanwhile: nothing to write
                del self._held[rid]
            elif (
                force
                or self.stream_interval == 1
                or p.final is not None
                or not p.rec.started
                or max(map(len, p.tokens.values()), default=0) >= self.stream_interval
            ):
                due.append(self._held.pop(rid))
        return due

    def _events(self, p: _Pending) -> tuple[list[bytes], bool]:
        """Encoded events for one request, and whether they end it. Sequence numbers are only
        committed once Redis holds them (`_commit`)."""
        rec, seq, events = p.rec, p.rec.next_seq, []
        attempt = rec.attempt
        if not rec.started:
            events.append(Started(seq=seq, worker=self.consumer, attempt=attempt))
            seq += 1
        for index in sorted(set(p.tokens) | set(p.text) | set(p.tool_calls)):
            lps = p.logprobs.get(index)
            texts = p.texts.get(index) if lps is not None else None
            events.append(
                Tokens(
                    seq=seq,
                    attempt=attempt,
                    index=index,
                    token_ids=p.tokens.get(index, []),
                    text=p.text.get(index, ""),
                    logprobs=lps,
                    top_logprobs=p.top_logprobs.get(index) if lps is not None else None,
                    content=p.content.get(index),
                    token_texts=texts[0] if texts else None,
                    token_bytes=texts[1] if texts else None,
                    top_token_texts=texts[2] if texts else None,
                    top_token_bytes=texts[3] if texts else None,
                )
            )
            seq += 1
            if index in p.tool_calls:  # parsed from the text of the Tokens event just before
                events.append(ToolCalls(seq=seq, attempt=attempt, index=index, tool_calls=p.tool_calls[index]))
                seq += 1
        final = p.final is not None and rec.live
        if final:
            events.append(self._final_event(rec, p.final, seq))
        return [encode_event(e) for e in events], final

    @staticmethod
    def _final_event(rec: InFlight, out: RequestOutput, seq: int) -> Finished | Error:
        if out.error:
            return Error(seq=seq, attempt=rec.attempt, code=out.error_code or "engine_error", message=out.error)
        m = out.metrics
        ms = lambda s: None if s is None else round(s * 1000, 3)
        completion = sum(len(c.token_ids) for c in out.outputs)  # cumulative, resumed tokens included
        return Finished(
            seq=seq,
            attempt=rec.attempt,
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

    def _call(self, p: _Pending) -> _Call:
        rec = p.rec
        events, final = self._events(p)
        ks, args = scripts.publish_call(
            rec.request_id,
            owner=self.consumer,
            epoch=rec.epoch,
            cap=rec.max_events,
            live_ttl_ms=self.live_ttl_ms,
            result_ttl_ms=self.retention.ms(rec.retention_ms),
            first_seq=rec.next_seq,
            events=events,
            final=final,
        )
        return _Call(p, len(events), final, ks, args)

    def _ack_call(self, p: _Pending) -> _Call:
        rec = p.rec
        ks, args = scripts.ack_call(
            self.model,
            rec.lane,
            rec.request_id,
            group=self.group,
            entry_id=rec.entry_id,
            result_ttl_ms=self.retention.ms(rec.retention_ms),
            tenant=rec.tenant,
            tokens=self._used_tokens(p.final) if p.final is not None else 0,
        )
        return _Call(p, 0, True, ks, args, ack=True)

    @staticmethod
    def _used_tokens(out: RequestOutput) -> int:
        """What a finished request counts against its tenant's tokens_per_minute: the prompt and
        completion tokens of its `Finished` event's usage (an `Error` event counts none)."""
        if out.error:
            return 0
        return len(out.prompt_token_ids) + sum(len(c.token_ids) for c in out.outputs)

    # --- running them --------------------------------------------------------------------------

    async def _flush(self, pending: list[_Pending]) -> None:
        calls = []
        for p in pending:
            if p.rec.live or p.tokens:
                calls.append(self._call(p))
            elif p.final is not None:  # handed over, nothing left to write
                self._handed_over(p.rec, p.final)
        if _EXIT_BEFORE_FINAL and any(c.final for c in calls):
            os._exit(137)  # fault injection: die between the engine step and the final write
        backoff = Backoff()
        while calls:
            retry, acks = await self._run(calls)
            calls = retry + acks
            if retry:
                await asyncio.sleep(backoff.next())

    async def _run(self, calls: list[_Call]) -> tuple[list[_Call], list[_Call]]:
        """One pipelined try; returns the calls to try again (transient failures), and the acks due
        for the final events just stored."""
        pipe = self.redis.pipeline(transaction=False)
        for c in calls:
            (steps.ACK if c.ack else steps.PUBLISH).queue(pipe, c.keys, c.args)
        self._queue_waits(pipe, calls)
        try:
            replies = await pipe.execute(raise_on_error=False)
        except Exception as e:
            if not is_transient(e):
                raise
            self._count_error(e, "publish failed, retrying")
            return calls, []
        for acked in replies[len(calls) :]:
            self._check_replicas(acked)
        if steps.missing(replies):
            await self._load_steps()
        retry, acks = [], []
        for c, reply in zip(calls, replies[: len(calls)], strict=True):
            if isinstance(reply, Exception):
                if is_transient(reply):
                    self._count_error(reply, "publish refused for now, retrying", request_id=c.pending.rec.request_id)
                    retry.append(c)
                else:
                    self._count_error(reply, "publish refused", request_id=c.pending.rec.request_id)
                    self.hooks.on_failed(c.pending.rec, reply)
                continue
            if c.ack:
                self._acked(c.pending)
            elif self._apply(c, scripts.read_publish(reply)):
                acks.append(self._ack_call(c.pending))
        return retry, acks

    def _queue_waits(self, pipe, calls: list[_Call]) -> None:
        """With --wait-replicas, a WAIT after the final events, on each node written (the same
        connection as the writes, in the same pipeline): their acks wait for the replicas."""
        if self.wait_replicas <= 0:
            return
        finals = [c.keys[0] for c in calls if c.final and not c.ack]
        for key in {node_of(self.redis, key): key for key in finals}.values():
            queue_wait(pipe, self.redis, key, self.wait_replicas, self.wait_timeout_ms)

    async def _load_steps(self) -> None:
        """A server without the scripts (restarted, promoted): load them; the refused calls are retried."""
        try:
            await steps.load(self.redis, [steps.PUBLISH, steps.ACK])
        except Exception as e:
            if not is_transient(e):
                raise
            self._count_error(e, "loading the scripts failed, retrying")

    def _check_replicas(self, acked) -> None:
        """Final events not yet on enough replicas within --wait-timeout-ms are reported, and their
        entries acked all the same (a worker must not stall when a replica is away): a failover in the
        next moments could lose such a final event after its entry is gone (ops/README.md)."""
        if isinstance(acked, Exception) or int(acked) < self.wait_replicas:
            self.metrics.labels(self.metrics.replication_lag).inc()
            self.log.warning("final events not yet replicated", replicas=str(acked), wanted=self.wait_replicas)

    def _count_error(self, e: BaseException, msg: str, **kw) -> None:
        self.metrics.labels(self.metrics.redis_errors).inc()
        log = self.log.warning if is_connection_error(e) or is_transient(e) else self.log.error
        log(msg, error=f"{type(e).__name__}: {e}", **kw)

    def _apply(self, c: _Call, reply: scripts.PublishReply) -> bool:
        """Take in a publish reply; whether the request's entry is now due for its ack."""
        rec = c.pending.rec
        if reply.status == "ok":
            self._commit(c.pending, c.n_events, c.final)
            return c.final
        if reply.status == "lost":
            rec.lost = True
            self.hooks.on_lost(rec)
        else:  # gap: the stream holds less than this worker wrote (Redis lost writes)
            self.hooks.on_gap(rec, reply.last_seq)
        return False

    def _commit(self, p: _Pending, n_events: int, final: bool) -> None:
        rec = p.rec
        rec.next_seq += n_events
        rec.started = True
        for index, ids in p.tokens.items():
            while len(rec.delivered) <= index:
                rec.delivered.append([])
            rec.delivered[index].extend(ids)
        if final:
            rec.final_written = True  # retired once its entry is acked (`_acked`)
        elif p.final is not None:
            self._handed_over(rec, p.final)

    def _acked(self, p: _Pending) -> None:
        assert p.final is not None
        if self.tracer is not None:
            self.tracer.finished(p.rec, p.final)
        record_finish(self.metrics, self.log, p.rec, p.final)
        self._retire(p.rec)

    def _retire(self, rec: InFlight) -> None:
        self.inflight.pop(rec.request_id, None)
        self.hooks.on_done(rec)

    def _handed_over(self, rec: InFlight, out: RequestOutput) -> None:
        if self.tracer is not None and rec.handover:
            self.tracer.handed_over(rec, out)
        self._retire(rec)
