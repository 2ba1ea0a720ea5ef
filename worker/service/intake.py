"""Takes request entries from the lane streams into the engine.

Pulls only what the engine can admit soon, so idle workers take the rest (load balancing with no
router). Lanes are read in priority order. Every entry is decoded and validated with the protocol's
strict decoder; a bad one gets an `Error` event (when its request id can be read), a copy in the
dead-letter stream with the reason, and an ack. Requests whose deadline has passed or that were
cancelled while queued are answered without compute. Entries reclaimed from a dead worker arrive
here too (`admit_reclaimed`), resumed from what their response stream already holds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from producer_sdk.contract import keys
from producer_sdk.contract.keys import ENTRY_DATA_FIELD, ENTRY_ID_FIELD, EVENT_FIELD
from producer_sdk.errors import MalformedPayload, ProtocolError
from producer_sdk.protocol import (
    REQUEST_ID_PATTERN,
    Error,
    Finished,
    GenerateRequest,
    Limits,
    Started,
    Tokens,
    decode_event,
    decode_request,
    encode_request,
)
from worker.engine.engine import LLMEngine, RequestError
from worker.engine.sampling_params import SamplingParams, SamplingParamsError
from worker.service.closer import EntryCloser
from worker.service.inflight import Entry, InFlight, InFlightTable
from worker.service.logging import get_logger
from worker.service.metrics import WorkerMetrics


class CorruptStream(Exception):
    """A response stream holds an entry that is no event: the request cannot be resumed from it."""


@dataclass
class Resume:
    """What a previous owner left in the response stream."""

    next_seq: int
    attempt: int
    delivered: list[list[int]]
    finished: bool


def to_engine_params(wire) -> SamplingParams:
    return SamplingParams(
        n=wire.n,
        max_tokens=wire.max_tokens,
        min_tokens=wire.min_tokens,
        temperature=wire.temperature,
        top_p=wire.top_p,
        top_k=max(wire.top_k, 0),
        min_p=wire.min_p,
        seed=wire.seed,
        stop=list(wire.stop),
        stop_token_ids=list(wire.stop_token_ids),
        ignore_eos=wire.ignore_eos,
        repetition_penalty=wire.repetition_penalty,
        presence_penalty=wire.presence_penalty,
        frequency_penalty=wire.frequency_penalty,
        logprobs=wire.logprobs,
        skip_special_tokens=wire.skip_special_tokens,
        include_stop_str_in_output=wire.include_stop_str_in_output,
    )


class Intake:
    def __init__(
        self,
        redis: aioredis.Redis,
        blocking_redis: aioredis.Redis,
        engine: LLMEngine,
        inflight: InFlightTable,
        *,
        model: str,
        consumer: str,
        limits: Limits,
        closer: EntryCloser,
        metrics: WorkerMetrics,
        capacity: Callable[[], int],
        wake_engine: Callable[[], None],
        block_ms: int = 1000,
    ) -> None:
        self.redis, self.blocking = redis, blocking_redis
        self.engine = engine
        self.inflight = inflight
        self.model, self.consumer, self.limits = model, consumer, limits
        self.closer = closer
        self.group = keys.group(model)
        self.streams = {lane: keys.lane_stream(model, lane) for lane in keys.LANES}
        self.metrics = metrics
        self.capacity = capacity
        self.wake_engine = wake_engine
        self.block_ms = block_ms
        self.capacity_changed = asyncio.Event()
        self.recently_cancelled: Callable[[str], bool] = lambda request_id: False  # set by the service
        self.log = get_logger("pagedq.intake", worker=consumer)

    # --- setup --------------------------------------------------------------------------------

    async def ensure_groups(self) -> None:
        """Create the consumer group on every lane (from the stream's start: entries queued before
        any worker existed are served)."""
        for stream in self.streams.values():
            try:
                await self.redis.xgroup_create(stream, self.group, id="0", mkstream=True)
            except ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    # --- the pull loop ------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            room = self.capacity()
            if room <= 0:
                self.capacity_changed.clear()
                await self.capacity_changed.wait()
                continue
            try:
                entries = await self._read(room)
            except ResponseError as e:
                if "NOGROUP" not in str(e):
                    raise
                self.log.warning("consumer group missing (Redis lost its data?): recreating")
                await self.ensure_groups()
                continue
            if entries:
                await self.admit(entries)

    async def _read(self, room: int) -> list[Entry]:
        """Up to `room` new entries, high lane first; block on all lanes when none is waiting."""
        entries: list[Entry] = []
        for stream in self.streams.values():
            if len(entries) >= room:
                break
            got = await self.redis.xreadgroup(self.group, self.consumer, {stream: ">"}, count=room - len(entries))
            entries += self._entries(got)
        if entries:
            return entries
        got = await self.blocking.xreadgroup(
            self.group, self.consumer, {s: ">" for s in self.streams.values()}, count=1, block=self.block_ms
        )
        return self._entries(got)

    def _entries(self, reply) -> list[Entry]:
        lane_of = {s: lane for lane, s in self.streams.items()}
        out = []
        for stream, items in reply or []:
            stream = stream.decode() if isinstance(stream, bytes) else stream
            for entry_id, fields in items:
                eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                out.append(Entry(lane_of[stream], stream, eid, fields or {}))
        return out

    # --- admission ----------------------------------------------------------------------------

    async def admit(self, entries: list[Entry], resumes: dict[str, Resume] | None = None) -> None:
        """Decode, check and hand entries to the engine (or answer them right away)."""
        decoded: list[tuple[Entry, GenerateRequest]] = []
        for e in entries:
            req = await self._decode(e)
            if req is not None:
                decoded.append((e, req))
        if not decoded:
            return
        cancelled = await self._cancel_flags([r.request_id for _, r in decoded])
        now_ms = time.time() * 1000
        for (e, req), is_cancelled in zip(decoded, cancelled, strict=True):
            resume = (resumes or {}).get(e.entry_id)
            if req.request_id in self.inflight:
                await self._dead_letter(e, req.request_id, "duplicate", "request id already running here", seq=None)
                continue
            next_seq = resume.next_seq if resume else 0
            if is_cancelled:
                await self._answer(e, req.request_id, Finished(seq=next_seq, finish_reason="abort"))
            elif req.deadline_ms is not None and req.deadline_ms <= now_ms:
                await self._answer(e, req.request_id, Finished(seq=next_seq, finish_reason="deadline"))
            else:
                await self._start(e, req, resume)

    async def _decode(self, e: Entry) -> GenerateRequest | None:
        raw_id = e.fields.get(ENTRY_ID_FIELD.encode(), b"")
        rid = raw_id.decode(errors="replace")
        readable_id = rid if REQUEST_ID_PATTERN.fullmatch(rid) else None
        payload = e.fields.get(ENTRY_DATA_FIELD.encode())
        try:
            if payload is None:
                raise MalformedPayload(f"entry has no '{ENTRY_DATA_FIELD}' field (the request payload)")
            req = decode_request(payload, self.limits)
        except ProtocolError as err:
            code = getattr(err, "code", "malformed") or "malformed"
            await self._dead_letter(e, readable_id, code, str(err), seq=0)
            return None
        if readable_id is not None and readable_id != req.request_id:
            msg = f"entry id field {readable_id!r} does not match the payload's request_id {req.request_id!r}"
            await self._dead_letter(e, readable_id, "schema", msg, seq=0)
            return None
        return req

    async def _cancel_flags(self, request_ids: list[str]) -> list[bool]:
        pipe = self.redis.pipeline(transaction=False)
        for rid in request_ids:
            pipe.exists(keys.cancel_flag(rid))
        return [bool(x) for x in await pipe.execute()]

    async def _start(self, e: Entry, req: GenerateRequest, resume: Resume | None) -> None:
        sp = req.sampling
        max_events = (sp.max_tokens or self.engine.max_model_len) * sp.n + 16
        rec = InFlight(
            request_id=req.request_id,
            lane=e.lane,
            stream=e.stream,
            entry_id=e.entry_id,
            request=req,
            max_events=max_events,
            deliveries=e.deliveries,
        )
        if resume is not None:
            rec.next_seq, rec.attempt, rec.delivered = resume.next_seq, resume.attempt, resume.delivered
        self.inflight[req.request_id] = rec
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.add_to_engine, rec)
        except (RequestError, SamplingParamsError, ValueError) as err:
            self.inflight.pop(req.request_id, None)
            code = getattr(err, "code", "invalid_request")
            await self._dead_letter(e, req.request_id, code, str(err), seq=rec.next_seq)
            return
        if self.recently_cancelled(req.request_id):  # cancelled while we were admitting it
            self.engine.abort_request(req.request_id)
        self.wake_engine()

    def add_to_engine(self, rec: InFlight, isolated: bool = False) -> None:
        """Runs in a thread: tokenizing a long prompt or rendering a chat must not stall the loop."""
        req = rec.request
        messages = [{"role": m.role, "content": m.content} for m in req.messages] if req.messages else None
        arrival = req.created_ms / 1000 if req.created_ms else None
        resume = None
        if rec.delivered:
            resume = [*rec.delivered, *([] for _ in range(req.sampling.n - len(rec.delivered)))]
        self.engine.add_request(
            req.request_id,
            req.prompt,
            to_engine_params(req.sampling),
            prompt_token_ids=req.prompt_token_ids,
            messages=messages,
            priority=req.priority,
            deadline=req.deadline_ms / 1000 if req.deadline_ms is not None else None,
            arrival_time=min(arrival, time.time()) if arrival else None,
            resume=resume,
            isolated=isolated,
        )

    # --- answers without compute --------------------------------------------------------------

    async def _answer(self, e: Entry, request_id: str, event: Finished) -> None:
        await self.closer.answer(e, request_id, event)

    async def _dead_letter(
        self, e: Entry, request_id: str | None, code: str, message: str, seq: int | None, attempt: int = 1
    ) -> None:
        await self.closer.refuse(e, request_id, code, message, seq=seq, attempt=attempt)

    async def dead_letter_record(self, rec: InFlight, code: str, message: str) -> None:
        """Dead-letter a request this worker had accepted (its payload re-encoded)."""
        payload = encode_request(rec.request, limits=None)
        entry = Entry(rec.lane, rec.stream, rec.entry_id, {ENTRY_DATA_FIELD.encode(): payload}, rec.deliveries)
        await self._dead_letter(entry, rec.request_id, code, message, seq=rec.next_seq, attempt=rec.attempt)

    # --- reclaim ------------------------------------------------------------------------------

    async def read_previous_attempt(self, request_id: str) -> Resume:
        """Replay the response stream earlier attempts wrote. Events of types this version does not
        know are skipped (their seq counted); an event that does not decode at all raises
        `CorruptStream`: the stream cannot be continued safely."""
        raw = await self.redis.xrange(keys.response_stream(request_id))
        next_seq, attempt, finished = 0, 0, False
        delivered: list[list[int]] = []
        for entry_id, fields in raw:
            data = fields.get(EVENT_FIELD.encode())
            try:
                if data is None:
                    raise MalformedPayload("entry has no event")
                ev = decode_event(data)
            except ProtocolError as err:
                raise CorruptStream(f"response entry {entry_id!r} of request {request_id}: {err}") from None
            if ev.seq != next_seq:  # a duplicate from an unfenced writer: the first copy counts
                continue
            next_seq += 1
            if isinstance(ev, Started):
                attempt = max(attempt, ev.attempt)
            elif isinstance(ev, Tokens):
                while len(delivered) <= ev.index:
                    delivered.append([])
                delivered[ev.index].extend(ev.token_ids)
            elif isinstance(ev, (Finished, Error)):
                finished = True
        return Resume(next_seq=next_seq, attempt=attempt + 1, delivered=delivered, finished=finished)

    async def admit_reclaimed(self, entries: list[Entry], max_deliveries: int) -> None:
        resumes: dict[str, Resume] = {}
        admit: list[Entry] = []
        for e in entries:
            rid = e.fields.get(ENTRY_ID_FIELD.encode(), b"").decode(errors="replace")
            if not REQUEST_ID_PATTERN.fullmatch(rid):
                admit.append(e)  # decoding refuses it with the right error
                continue
            mine = self.inflight.get(rid)
            if mine is not None and mine.entry_id == e.entry_id:
                continue  # our own entry, renewed late: the claim just reset its idle time
            try:
                resume = await self.read_previous_attempt(rid)
            except CorruptStream as err:
                await self._dead_letter(e, rid, "stream_corrupt", str(err), seq=None)
                continue
            if resume.finished:  # the final event made it, the ack did not: just ack
                await self.closer.ack(e, rid, resume.next_seq - 1)
                continue
            if e.deliveries > max_deliveries:
                msg = f"delivered {e.deliveries} times without finishing (max_deliveries={max_deliveries})"
                await self._dead_letter(e, rid, "max_deliveries", msg, seq=resume.next_seq)
                continue
            self.metrics.labels(self.metrics.reclaimed).inc()
            self.log.info(
                "resuming request",
                request_id=rid,
                attempt=resume.attempt,
                delivered=sum(len(d) for d in resume.delivered),
            )
            resumes[e.entry_id] = resume
            admit.append(e)
        if admit:
            await self.admit(admit, resumes)
