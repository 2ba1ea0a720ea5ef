"""Turns request entries into engine requests, or answers them at once.

Every entry is decoded and validated with the protocol's strict decoder. A bad one is refused (an
`Error` event when its request id can be read, a dead letter, the ack); one cancelled or past its
deadline while queued is answered without compute; the rest are tokenized and added to the engine
on one dedicated thread (a tokenizer is not safe to share between threads, and a long prompt must
not stall the event loop). The requests of one batch of entries join the engine as one command, so
the first step after a burst holds all of it. Whatever goes wrong while admitting one entry ends that
entry with a typed error and touches no other: no in-flight record is ever left without an engine
request.
Reclaimed entries (a dead worker's) are resumed from what their response stream holds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec
import redis.asyncio as aioredis

from producer_sdk.chat import structured_outputs_for
from producer_sdk.contract import keys, scripts, steps
from producer_sdk.contract.keys import ENTRY_DATA_FIELD
from producer_sdk.contract.redis_errors import is_transient
from producer_sdk.errors import MalformedPayload, ProtocolError
from producer_sdk.protocol import Finished, GenerateRequest
from producer_sdk.request_codec import decode_request, encode_request
from producer_sdk.validation import Limits
from worker.engine.engine import LLMEngine
from worker.engine.errors import RequestError
from worker.engine.request import Request
from worker.engine.sampling_params import SamplingParams
from worker.service.closer import EntryCloser
from worker.service.inflight import Entry, EntryKey, InFlight, InFlightTable
from worker.service.logging import get_logger
from worker.service.metrics import WorkerMetrics
from worker.service.replay import CorruptStream, Resume, replay
from worker.service.tracing import RequestTracer


@dataclass
class Starting:
    """An entry whose request joins the engine with the rest of its batch."""

    entry: Entry
    rec: InFlight


@dataclass
class Taken:
    """What taking an entry's lease found."""

    cancelled: bool
    lease: scripts.AcquireReply | None
    stream: Any  # XRANGE of the response stream
    error: Exception | None = None  # what Redis refused for this entry alone (a key of the wrong type, ...)


def _superseded(entries: list[Entry]) -> dict[EntryKey, str]:
    """Entry key -> the newest entry id of the same request in `entries`, for every older one."""
    newest: dict[str, Entry] = {}
    for e in entries:
        rid = e.request_id
        if rid is not None and (rid not in newest or scripts.entry_newer(e.entry_id, newest[rid].entry_id)):
            newest[rid] = e
    return {
        e.key: newest[e.request_id].entry_id
        for e in entries
        if e.request_id is not None and newest[e.request_id].key != e.key
    }


def _taken(replies: list[Any]) -> Taken:
    """An entry's three replies (EXISTS cancel flag, acquire, XRANGE stream)."""
    error = next((r for r in replies if isinstance(r, Exception)), None)
    if error is not None:
        return Taken(False, None, None, error)
    return Taken(bool(replies[0]), scripts.read_acquire(replies[1]), replies[2])


class Admission:
    def __init__(
        self,
        redis: aioredis.Redis,
        engine: LLMEngine,
        inflight: InFlightTable,
        closer: EntryCloser,
        *,
        limits: Limits,
        max_deliveries: int,
        metrics: WorkerMetrics,
        recently_cancelled: Callable[[str], bool],
        wake_engine: Callable[[], None],
        consumer: str,
        lease_ttl_ms: int,
        tracer: RequestTracer | None = None,
    ) -> None:
        self.redis = redis
        self.engine = engine
        self.inflight = inflight
        self.closer = closer
        self.limits = limits
        self.max_deliveries = max_deliveries
        self.metrics = metrics
        self.recently_cancelled = recently_cancelled
        self.wake_engine = wake_engine
        self.tracer = tracer
        self.tenant_weight: Callable[[str], float] = lambda tenant: 1.0  # the intake's fair-share weights
        self.consumer, self.lease_ttl_ms = consumer, lease_ttl_ms
        self.tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self.mean_seats: float | None = None  # moving average of n over decoded requests
        self.log = get_logger("pagedq.intake", worker=consumer)

    def idle(self) -> bool:
        """Nothing in flight: the next entry is taken whatever its size (someone has to run it)."""
        return not self.inflight

    def close(self) -> None:
        self.tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    # --- new and reclaimed entries ------------------------------------------------------------

    async def admit(self, entries: list[Entry]) -> None:
        """New entries, each on its own."""
        await self._admit_batch(entries, reclaimed=False)

    async def resume(self, entries: list[Entry]) -> None:
        """Entries taken over from a dead worker: finished ones are only acked, the rest resume."""
        await self._admit_batch(entries, reclaimed=True)

    async def _admit_batch(self, entries: list[Entry], *, reclaimed: bool) -> None:
        # Two entries of one request id (a resubmit, say after its marker expired) in one batch: only
        # the newest takes the lease (as `_stale` decides between batches), the others are duplicates.
        newer = _superseded(entries)
        fresh = [e for e in entries if e.key not in newer]
        starting: list[Starting] = []
        try:
            for e, taken in zip(fresh, await self._take(fresh), strict=True):
                await self._guarded(e, self._admit_taken(e, taken, starting, reclaimed=reclaimed))
        finally:  # even when Redis failed for a later entry: the records already made must run
            await self._start_all(starting)
        for e in entries:
            if e.key in newer:
                msg = f"a newer entry ({newer[e.key]}) of this request id runs it"
                await self._guarded(e, self.closer.refuse(e, e.request_id, "duplicate", msg, seq=None))

    async def _guarded(self, e: Entry, work) -> None:
        """Run one entry's admission; anything but a Redis outage ends that entry alone."""
        try:
            await work
        except Exception as err:
            if is_transient(err):
                raise  # the pull loop retries; the entry stays pending and is reclaimed later
            self.log.exception("admission failed", entry=e.entry_id, request_id=e.request_id)
            rec = self.inflight.get(e.request_id or "")
            if rec is not None and rec.key == e.key:
                self.inflight.pop(rec.request_id)
            msg = f"the worker could not admit this request: {type(err).__name__}: {err}"
            await self.closer.refuse(e, e.request_id, "internal_error", msg, seq=None)

    async def _take(self, entries: list[Entry]) -> list[Taken | None]:
        """For each entry with a request id (and not running here already): its cancel flag, then its
        lease for this delivery, then what its response stream holds (read after the lease is ours,
        so no earlier attempt writes after it), all in one round trip. None for the others."""
        calls: list[steps.Call | steps.Cmd] = []
        mine = [e for e in entries if self._takes_lease(e)]
        for e in mine:
            rid = e.request_id or ""
            ks, args = scripts.acquire_call(rid, owner=self.consumer, epoch=e.epoch, ttl_ms=self.lease_ttl_ms)
            calls += [steps.Cmd("EXISTS", keys.cancel_flag(rid)), (steps.ACQUIRE, ks, args)]
            calls.append(steps.Cmd("XRANGE", keys.response_stream(rid), "-", "+"))
        replies = await steps.run_many(self.redis, calls, resend_all=True) if calls else []
        for reply in replies:
            if isinstance(reply, Exception) and is_transient(reply):
                raise reply  # the pull loop retries; the entries stay pending
        got = {e.key: _taken(replies[3 * i : 3 * i + 3]) for i, e in enumerate(mine)}
        return [got.get(e.key) for e in entries]

    def _takes_lease(self, e: Entry) -> bool:
        rec = self.inflight.get(e.request_id or "")
        return e.request_id is not None and rec is None

    async def _admit_taken(self, e: Entry, taken: Taken | None, starting: list[Starting], *, reclaimed: bool) -> None:
        rid = e.request_id
        if taken is None:
            mine = self.inflight.get(rid or "")
            if mine is not None and mine.key == e.key:
                return  # our own entry, renewed late: the claim just reset its idle time
            if mine is not None:  # another entry of a request running here: its lease is not this one's
                await self.closer.refuse(e, rid, "duplicate", "request id already running here", seq=None)
                return
            await self._admit_one(e, None, False, starting)  # no request id: decoding refuses it
            return
        assert rid is not None
        if taken.error is not None:  # say a key of the wrong type: this entry alone ends
            msg = f"the request's keys cannot be used: {type(taken.error).__name__}: {taken.error}"
            await self.closer.refuse(e, rid, "stream_unwritable", msg, seq=None)
            return
        assert taken.lease is not None
        if not taken.lease.ok:
            await self._stale(e, rid, taken.lease)
            return
        try:
            resume = replay(taken.stream, rid)
        except CorruptStream as err:
            await self.closer.refuse(e, rid, "stream_corrupt", str(err), seq=None)
            return
        if resume.finished and reclaimed:  # the final event made it, the ack did not: just ack
            await self.closer.ack(e, rid, tokens=resume.used_tokens)
            return
        if resume.finished:  # a new entry of a request already answered: a duplicate submission
            await self.closer.refuse(e, rid, "duplicate", "this request id was already answered", seq=None)
            return
        if e.deliveries > self.max_deliveries:
            msg = f"delivered {e.deliveries} times without finishing (max_deliveries={self.max_deliveries})"
            await self.closer.refuse(e, rid, "max_deliveries", msg, seq=resume.next_seq, attempt=resume.attempt)
            return
        if reclaimed or resume.next_seq:
            self.metrics.labels(self.metrics.reclaimed).inc()
            self.log.info("resuming request", request_id=rid, attempt=resume.attempt, delivered=resume.tokens)
            await self._admit_one(e, resume, taken.cancelled, starting)
        else:
            await self._admit_one(e, None, taken.cancelled, starting)

    async def _stale(self, e: Entry, request_id: str, lease: scripts.AcquireReply) -> None:
        """A newer delivery holds the request's lease. Of this entry: another worker runs it now (nothing
        to do here). Of a newer entry of the same request (a resubmit): this one is a duplicate."""
        holder = scripts.epoch_entry(lease.holder_epoch or "")
        if holder == e.entry_id or not scripts.entry_newer(holder, e.entry_id):
            self.log.info("entry taken over by another worker", request_id=request_id, holder=lease.holder)
            return
        msg = f"a newer entry ({holder}) of this request id runs it"
        await self.closer.refuse(e, request_id, "duplicate", msg, seq=None)

    async def _admit_one(self, e: Entry, resume: Resume | None, is_cancelled: bool, starting: list[Starting]) -> None:
        req = await self._decode(e)
        if req is None:
            return
        seq, attempt = (resume.next_seq, resume.attempt) if resume else (0, 1)
        if req.request_id in self.inflight:
            msg = "request id already running here"
            await self.closer.refuse(e, req.request_id, "duplicate", msg, seq=None)
            if self.tracer is not None:
                self.tracer.ended_early(req, e, attempt, error_code="duplicate", message=msg)
            return
        if is_cancelled:
            reason = "abort"
        elif req.deadline_ms is not None and req.deadline_ms <= time.time() * 1000:
            reason = "deadline"
        else:
            starting.append(Starting(e, self._record(e, req, resume)))
            return
        await self.closer.answer(e, req.request_id, Finished(seq=seq, attempt=attempt, finish_reason=reason))
        if self.tracer is not None:
            self.tracer.ended_early(req, e, attempt, finish_reason=reason)

    async def _decode(self, e: Entry) -> GenerateRequest | None:
        payload = e.fields.get(ENTRY_DATA_FIELD.encode())
        try:
            if payload is None:
                raise MalformedPayload(f"entry has no '{ENTRY_DATA_FIELD}' field (the request payload)")
            req = decode_request(payload, self.limits)
        except ProtocolError as err:
            await self.closer.refuse(e, e.request_id, getattr(err, "code", "malformed") or "malformed", str(err), seq=0)
            return None
        n = req.sampling.n
        self.mean_seats = n if self.mean_seats is None else 0.8 * self.mean_seats + 0.2 * n
        if e.request_id is not None and e.request_id != req.request_id:
            msg = f"entry id field {e.request_id!r} does not match the payload's request_id {req.request_id!r}"
            await self.closer.refuse(e, e.request_id, "schema", msg, seq=0)
            return None
        return req

    # --- into the engine ----------------------------------------------------------------------

    def _record(self, e: Entry, req: GenerateRequest, resume: Resume | None) -> InFlight:
        """The in-flight record of an entry about to start (registered now, so a repeat in the same
        batch is seen as a duplicate)."""
        sp = req.sampling
        rec = InFlight(
            request_id=req.request_id,
            lane=e.lane,
            stream=e.stream,
            entry_id=e.entry_id,
            request=req,
            max_events=(sp.max_tokens or self.engine.limits.max_model_len) * sp.n + 16,
            tenant=e.tenant,
            retention_ms=e.retention_ms,
            deliveries=e.deliveries,
            read_at=e.read_at,
        )
        if resume is not None:
            rec.next_seq, rec.attempt, rec.delivered = resume.next_seq, resume.attempt, resume.delivered
            rec.resumed_tokens = resume.tokens
        self.inflight[req.request_id] = rec
        return rec

    async def _start_all(self, starting: list[Starting]) -> None:
        """Tokenize the batch's requests and add them to the engine together; end those that fail."""
        if not starting:
            return
        recs = [s.rec for s in starting]
        errors = await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, self._add_all, recs, False)
        failed = [(s, err) for s, err in zip(starting, errors, strict=True) if err is not None]
        for s, _ in failed:
            self.inflight.pop(s.rec.request_id, None)
        for s, err in zip(starting, errors, strict=True):
            if err is None:
                self.log.debug("request admitted", request_id=s.rec.request_id, tenant=s.rec.tenant, lane=s.entry.lane)
                if self.recently_cancelled(s.rec.request_id):  # cancelled while we were admitting it
                    self.engine.abort_request(s.rec.request_id)
        if len(failed) < len(starting):
            self.wake_engine()
        outage = next((err for _, err in failed if is_transient(err)), None)
        for s, err in failed:
            if not is_transient(err):
                await self._guarded(s.entry, self._refuse_start(s, err))
        if outage is not None:
            raise outage  # the pull loop retries; the entry stays pending and is reclaimed later

    async def _refuse_start(self, s: Starting, err: Exception) -> None:
        rec = s.rec
        code = getattr(err, "code", None) or ("invalid_request" if isinstance(err, ValueError) else "internal_error")
        await self.closer.refuse(s.entry, rec.request_id, code, str(err), seq=rec.next_seq, attempt=rec.attempt)
        if self.tracer is not None:
            self.tracer.ended_early(rec.request, s.entry, rec.attempt, error_code=code, message=str(err))

    async def add_to_engine(self, rec: InFlight, isolated: bool = False) -> None:
        """Tokenize (and render the chat template) on the tokenizer thread, then queue the request."""
        loop = asyncio.get_running_loop()
        [error] = await loop.run_in_executor(self.tokenizer_thread, self._add_all, [rec], isolated)
        if error is not None:
            raise error

    def _add_all(self, recs: list[InFlight], isolated: bool) -> list[Exception | None]:
        """On the tokenizer thread: prepare each request, then queue all that could be in one command.
        Per record, the error that kept it out (None: queued)."""
        prepared: list[Request | None] = []
        errors: list[Exception | None] = []
        for rec in recs:
            try:
                prepared.append(self._prepare(rec, isolated))
                errors.append(None)
            except Exception as err:
                prepared.append(None)
                errors.append(err)
        try:
            self.engine.add_prepared([p for p in prepared if p is not None])
        except RequestError:  # one runs already: each alone, so that only that one fails
            for i, p in enumerate(prepared):
                if p is not None:
                    try:
                        self.engine.add_prepared([p])
                    except RequestError as err:
                        errors[i] = err
        now = time.time()
        for rec, err in zip(recs, errors, strict=True):
            if err is None:
                rec.added_at = now
        return errors

    def _prepare(self, rec: InFlight, isolated: bool) -> Request:
        req = rec.request
        messages = [msgspec.to_builtins(m) for m in req.messages] if req.messages else None
        arrival = req.created_ms / 1000 if req.created_ms else None
        resume = None
        if rec.delivered:
            resume = [*rec.delivered, *([] for _ in range(req.sampling.n - len(rec.delivered)))]
        params = SamplingParams.from_wire(req.sampling)
        if req.response_format is not None:  # v2: OpenAI's response_format is a structured-output constraint
            params.structured_outputs = structured_outputs_for(req.response_format)
        return self.engine.prepare_request(
            req.request_id,
            req.prompt,
            params,
            prompt_token_ids=req.prompt_token_ids,
            messages=messages,
            add_generation_prompt=req.add_generation_prompt,
            priority=req.priority,
            deadline=req.deadline_ms / 1000 if req.deadline_ms is not None else None,
            arrival_time=min(arrival, time.time()) if arrival else None,
            resume=resume,
            isolated=isolated,
            tenant=rec.tenant,
            tenant_weight=self.tenant_weight(rec.tenant),
            tools=[t.as_openai() for t in req.tools] if req.tools is not None else None,
            tool_choice=msgspec.to_builtins(req.tool_choice) if req.tool_choice is not None else None,
            parallel_tool_calls=req.parallel_tool_calls,
        )

    async def dead_letter(self, rec: InFlight, code: str, message: str) -> None:
        """Dead-letter a request this worker had accepted (its payload re-encoded)."""
        payload = encode_request(rec.request, limits=None)
        entry = Entry(rec.lane, rec.stream, rec.entry_id, rec.fields(payload), rec.deliveries)
        await self.closer.refuse(entry, rec.request_id, code, message, seq=rec.next_seq, attempt=rec.attempt)
