"""A test double of the pagedq *worker* for the SDK tests (Redis itself is always real).

It implements the worker's half of the Redis contract documented in producer_sdk/protocol.py:
consumer group on every lane (high lane first), decode + validate with the protocol module,
Error event + dead letter for bad entries, Started / Tokens / Finished events with contiguous seq,
the final event, then XACK + XDEL (as the worker: the ack after the final event), cancel flag
checked before every token, deadlines, and a pub/sub listener that records control messages.

Generation is fake and deterministic: sample `index` token `i` has id ``1000 * index + i`` and
text ``"w{i} "``; `max_tokens` tokens (prompt "forever": until cancel or deadline); prompt "fail"
answers an Error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import redis.exceptions as rex
from redis.asyncio.retry import Retry
from redis.backoff import ConstantBackoff

from producer_sdk.contract import keys
from producer_sdk.contract.cluster import is_cluster, node_client
from producer_sdk.contract.connection import client_options, redis_from_url
from producer_sdk.contract.keys import ENTRY_DATA_FIELD, ENTRY_ID_FIELD, EVENT_FIELD
from producer_sdk.errors import ProtocolError
from producer_sdk.protocol import (
    Error,
    Event,
    Finished,
    GenerateRequest,
    Started,
    Timings,
    Tokens,
    Usage,
    decode_control,
    encode_event,
    now_ms,
)
from producer_sdk.request_codec import decode_request

LANES = keys.LANES


async def wait_for(cond, timeout: float = 5.0, what: str = "condition") -> None:
    """Poll `cond()` (sync or async) until true, failing after `timeout` seconds."""
    end = time.monotonic() + timeout
    while True:
        value = cond()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


class FakeWorker:
    def __init__(
        self,
        redis_url: str,
        model: str = "default",
        *,
        name: str = "fake-1",
        token_delay: float = 0.0,
        pause_after: int | None = None,
        cap: int = 10_000,
        ttl_s: int = 3600,
    ) -> None:
        # redis-py retries a command through a Redis restart here (the fake resends blindly: it is
        # a test double); the socket timeout stays explicit whatever redis-py's defaults are.
        options = client_options(asyncio=True, socket_timeout=10.0)
        options.update(retry=Retry(ConstantBackoff(0.02), 50), retry_on_error=[rex.ConnectionError, rex.TimeoutError])
        self.redis = redis_from_url(redis_url, asyncio=True, **options)  # one node or a cluster
        self.model = model
        self.name = name
        self.token_delay = token_delay
        self.pause_after = pause_after  # tokens emitted before waiting on `resume`
        self.resume = asyncio.Event()
        self.cap = cap
        self.ttl_s = ttl_s
        self.group = keys.group(model)
        self.streams = [keys.lane_stream(model, lane) for lane in LANES]
        self.requests: list[GenerateRequest] = []  # intake order
        self.control: list = []
        self.emitted: dict[str, int] = {}  # request id -> tokens emitted
        self.finished: dict[str, str] = {}  # request id -> finish reason / error code
        self._tasks: set[asyncio.Task] = set()
        self._ending: set[str] = set()  # requests between their final event and their ack
        self._stopping = False
        self._subscribed = asyncio.Event()

    async def __aenter__(self) -> FakeWorker:
        await self._ensure_groups()
        await self.redis.zadd(keys.models(), {self.model: int(time.time() * 1000)})  # as a worker's heartbeat
        self._spawn(self._intake())
        self._spawn(self._listen())
        await asyncio.wait_for(self._subscribed.wait(), 5)
        return self

    async def __aexit__(self, *exc) -> None:
        # As a worker's drain: a request whose final event is out gets its ack before the fake stops.
        with contextlib.suppress(AssertionError):
            await wait_for(lambda: not self._ending, 2.0, "the acks under way")
        # Its tasks stop on their own between two commands: redis-py (8, on a cluster above all) can
        # leave a task cancelled in the middle of a command waiting forever.
        self._stopping = True
        self.resume.set()
        tasks = list(self._tasks)
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=3)
            for t in stuck:
                t.cancel()
            if stuck:
                await asyncio.wait(stuck, timeout=2)
        await self.redis.aclose()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _ensure_groups(self) -> None:
        for s in self.streams:
            with contextlib.suppress(rex.ResponseError):  # BUSYGROUP
                await self.redis.xgroup_create(s, self.group, id="0", mkstream=True)

    # -- intake ------------------------------------------------------------------------------------

    async def _intake(self) -> None:
        while not self._stopping:
            try:
                got = None
                for s in self.streams:  # high lane first
                    got = await self.redis.xreadgroup(self.group, self.name, {s: ">"}, count=1)
                    if got:
                        break
                if not got:
                    got = await self.redis.xreadgroup(
                        self.group, self.name, dict.fromkeys(self.streams, ">"), count=1, block=20
                    )
            except rex.ResponseError as e:
                if "NOGROUP" in str(e):  # redis lost its data (restart): recreate the groups
                    await self._ensure_groups()
                    continue
                raise
            except rex.ConnectionError:
                await asyncio.sleep(0.02)
                continue
            for stream, entries in got or []:
                for entry_id, fields in entries:
                    await self._take(stream.decode(), entry_id.decode(), fields)

    async def _take(self, stream: str, entry_id: str, fields: dict) -> None:
        rid = fields.get(ENTRY_ID_FIELD.encode(), b"").decode(errors="replace")
        try:
            req = decode_request(fields.get(ENTRY_DATA_FIELD.encode(), b""))
        except ProtocolError as e:
            await self._dead_letter(stream, entry_id, rid, e, fields)
            return
        self.requests.append(req)
        self._spawn(self._generate(stream, entry_id, req))

    async def _dead_letter(self, stream, entry_id, rid, err: ProtocolError, fields) -> None:
        if rid:
            await self._finish(stream, entry_id, rid, Error(seq=0, code=err.code, message=str(err)))
        else:
            await self._ack(stream, entry_id)
        lane = LANES[self.streams.index(stream)]
        await self.redis.xadd(
            keys.dead_letters(self.model),
            {
                "id": rid,
                "reason": str(err),
                "code": err.code,
                "lane": lane,
                "entry": entry_id,
                "payload": fields.get(ENTRY_DATA_FIELD.encode(), b""),
                "worker": self.name,
            },
        )

    # -- generation --------------------------------------------------------------------------------

    async def _generate(self, stream: str, entry_id: str, req: GenerateRequest) -> None:
        rid, s = req.request_id, req.sampling
        seq = 0
        t0 = now_ms()
        reasons = ["length"] * s.n

        def fin(reason: str, count: int) -> Finished:
            return Finished(
                seq=seq,
                finish_reason=reason,
                finish_reasons=[reason] * s.n if reason != "length" else reasons,
                usage=Usage(prompt_tokens=3, completion_tokens=count * s.n),
                timings=Timings(queue_ms=float(t0 - req.created_ms), ttft_ms=1.0, e2e_ms=float(now_ms() - t0)),
            )

        if await self._retry(self.redis.exists, keys.cancel_flag(rid)):
            await self._finish(stream, entry_id, rid, fin("abort", 0))
            return
        if req.deadline_ms is not None and now_ms() >= req.deadline_ms:
            await self._finish(stream, entry_id, rid, fin("deadline", 0))
            return
        await self._emit(rid, Started(seq=seq, worker=self.name, attempt=1))
        seq += 1
        if req.prompt == "fail":
            await self._finish(stream, entry_id, rid, Error(seq=seq, code="engine_error", message="boom"))
            return
        forever = req.prompt == "forever"
        limit = s.max_tokens or 16
        i = 0
        while forever or i < limit:
            if self.pause_after is not None and i == self.pause_after:
                await self.resume.wait()
            if self._stopping:
                return  # (as a worker that stops: no final event)
            if await self._retry(self.redis.exists, keys.cancel_flag(rid)):
                await self._finish(stream, entry_id, rid, fin("abort", i))
                return
            if req.deadline_ms is not None and now_ms() >= req.deadline_ms:
                await self._finish(stream, entry_id, rid, fin("deadline", i))
                return
            for index in range(s.n):
                logprobs = top = None
                if s.logprobs is not None:
                    logprobs = [-0.5]
                    top = [[(1000 * index + i, -0.5)] + [(7, -3.0)] * s.logprobs]
                ev = Tokens(
                    seq=seq,
                    index=index,
                    token_ids=[1000 * index + i],
                    text=f"w{i} ",
                    logprobs=logprobs,
                    top_logprobs=top,
                )
                await self._emit(rid, ev)
                seq += 1
            i += 1
            self.emitted[rid] = i
            await asyncio.sleep(self.token_delay)
        await self._finish(stream, entry_id, rid, fin("length", i))

    async def _retry(self, call, *args):
        """`call(*args)` again after a dropped connection (a blind resend: this is a test double)."""
        for _ in range(200):
            try:
                return await call(*args)
            except rex.ConnectionError:
                await asyncio.sleep(0.02)
        return await call(*args)

    async def _emit(self, rid: str, ev: Event) -> None:
        key = keys.response_stream(rid)

        async def write() -> None:
            pipe = self.redis.pipeline(transaction=False)
            pipe.xadd(key, {EVENT_FIELD: encode_event(ev)}, maxlen=self.cap, approximate=True)
            pipe.expire(key, self.ttl_s)
            await pipe.execute()

        await self._retry(write)

    async def _finish(self, stream: str, entry_id: str, rid: str, ev: Event) -> None:
        self._ending.add(rid)
        try:
            await self._emit(rid, ev)  # the final event, then the ack (two hash slots)
            await self._ack(stream, entry_id)
        finally:
            self._ending.discard(rid)
        self.finished[rid] = ev.finish_reason if isinstance(ev, Finished) else ev.code

    async def _ack(self, stream: str, entry_id: str) -> None:
        async def ack() -> None:
            pipe = self.redis.pipeline(transaction=False)
            pipe.xack(stream, self.group, entry_id)
            pipe.xdel(stream, entry_id)
            await pipe.execute()

        await self._retry(ack)

    # -- control -----------------------------------------------------------------------------------

    async def _listen(self) -> None:
        channel = keys.control_channel(self.model)
        node = await node_client(self.redis, channel) if is_cluster(self.redis) else None
        ps = (node or self.redis).pubsub()
        try:
            await ps.subscribe(channel)
            while not self._stopping:
                msg = await ps.get_message(timeout=0.05)
                if msg is None:
                    continue
                if msg["type"] == "subscribe":
                    self._subscribed.set()
                elif msg["type"] == "message":
                    self.control.append(decode_control(msg["data"]))
        finally:
            await ps.aclose()
            if node is not None:
                await node.aclose()
