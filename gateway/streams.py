"""Reading a request's response stream into SSE frames, and the ASGI responses that send them while
watching for the client to go away.

The reader is the SDK's own (`Follower`: resume from the last Redis id, duplicates dropped by seq,
liveness checks), driven here so that every XREAD reply becomes one write to the socket.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from gateway import errors
from gateway.metrics import GatewayMetrics
from gateway.render import DONE, Renderer, error_frame
from gateway.stream_limit import Slot
from producer_sdk._stream import CompletionBuilder, Follower
from producer_sdk.client import Handle
from producer_sdk.errors import PagedqError
from producer_sdk.protocol import Tokens, ToolCalls
from producer_sdk.results import Chunk, Completion

log = logging.getLogger("pagedq.gateway")
# Events one XREAD of a stream returns at most, so that one SSE frame, and the reply it came from, stay
# small beside a connection's write buffer (--write-buffer-bytes) even when a finished answer is replayed:
# a client that does not read holds its buffers and about one frame (a live stream gets about one event
# an XREAD anyway; the SDK's own readers take 512).
READ_COUNT = 16


class _FinishOnly(CompletionBuilder):
    """A builder that keeps which samples had tokens, not the tokens: an SSE stream has sent them on,
    and its finish needs only the final event (a stream of N tokens with 20 logprobs each would keep
    about 10 KiB of objects a token)."""

    def add(self, ev: Tokens) -> None:
        self.ids.setdefault(ev.index, [])

    def add_tool_calls(self, ev: ToolCalls) -> None:
        self.calls.setdefault(ev.index, {})


class Reading:
    """One reader of one request: the chunks of each XREAD reply, batch by batch; afterwards `completion`
    and `final_seq` (the seq of the Finished event) are known. A reader `for_sse` reads at most READ_COUNT
    events at a time, and its completion has no text, tokens or logprobs, only its finish (what an SSE
    stream ends with): it holds little while its client is slow."""

    def __init__(self, handle: Handle, timeout: float | None = None, *, for_sse: bool = False) -> None:
        self.handle = handle
        self.follower: Follower = handle._follower(handle._client._opts, timeout)
        if for_sse:
            self.follower.count = min(self.follower.count, READ_COUNT)
            self.follower.builder = _FinishOnly(handle.request_id)
        self.completion: Completion | None = None
        self.final_seq = -1
        self._replies: AsyncIterator[Iterator[Chunk]] | None = None

    async def next_batch(self) -> list[Chunk] | None:
        """The chunks of the next reply that has any; None once the request is over. (A method, not a
        generator: a caller that drops the batch holds none of it while it waits on its client.)"""
        f = self.follower
        if self._replies is None:
            self._replies = self.handle._batches(f)
        async for chunks in self._replies:
            batch = list(chunks)
            if batch:
                return batch
        self.completion = f.completion()
        self.final_seq = f.expected_seq - 1
        return None

    async def batches(self) -> AsyncIterator[list[Chunk]]:
        while (batch := await self.next_batch()) is not None:
            yield batch

    async def result(self) -> Completion:
        while await self.next_batch() is not None:
            pass
        assert self.completion is not None
        return self.completion


async def sse_frames(
    reading: Reading,
    renderer: Renderer,
    *,
    n: int,
    after: int = -1,
    on_first_token: Callable[[], None] | None = None,
    api_error: Callable[[PagedqError], errors.ApiError] = errors.from_sdk,
) -> AsyncIterator[bytes]:
    """The SSE body of a request from event seq `after` + 1 on (-1: from the start). Chat streams
    begin with the role chunk of each choice, numbered 0 like the Started event. A chunk with nothing
    to say (tool-call markup only: no content, no logprobs) is left out. An error is sent as
    `api_error` renders it."""
    if renderer.kind == "chat" and after < 0:
        yield renderer.role_frame(n)
    try:
        while (batch := await reading.next_batch()) is not None:
            frames = b"".join(renderer.token_frame(c) for c in batch if c.seq > after)
            del batch  # (not held while the frame waits on a client that reads slowly)
            if frames:
                if on_first_token is not None:
                    on_first_token()
                    on_first_token = None
                yield frames
    except PagedqError as e:
        yield error_frame(api_error(e).json()) + DONE
        return
    done, seq = reading.completion, reading.final_seq
    assert done is not None
    if seq > after:
        if done.finish_reason == "deadline":
            yield b"id: %d\n" % seq + error_frame(errors.deadline(done.request_id).json())
        else:
            yield renderer.finish_frames(seq, done)
    yield DONE


async def wait_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    """Returns when the client has gone (uvicorn also says so once the response is complete)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class EventStream:
    """An SSE response (ASGI). If the client leaves before the end, the body is abandoned and
    `on_disconnect` runs (it cancels the request unless the client asked to resume later). `slot`, the
    stream's place under its key's --max-streams-per-key, is given back when the response ends."""

    def __init__(
        self,
        body: AsyncIterator[bytes],
        *,
        metrics: GatewayMetrics,
        on_disconnect: Callable[[], Awaitable[None]] | None = None,
        headers: dict[str, str] | None = None,
        slot: Slot | None = None,
    ) -> None:
        self.body = body
        self.metrics = metrics
        self.on_disconnect = on_disconnect
        self.slot = slot
        self.headers = SSE_HEADERS + [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        try:
            await self._stream(receive, send)
        finally:
            if self.slot is not None:
                self.slot.release()

    async def _stream(self, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})
        self.metrics.open_streams.inc()
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(wait_disconnect(receive))
        finished = False
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
            finished = pump.done() and not pump.cancelled() and pump.exception() is None
            if pump.done() and pump.exception() is not None:
                log.error("stream failed", exc_info=pump.exception())
        finally:
            self.metrics.open_streams.dec()
            for task in (pump, watch):
                task.cancel()
            if not finished and self.on_disconnect is not None:
                await asyncio.shield(self.on_disconnect())
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _pump(self, send: Any) -> None:
        async for frame in self.body:
            await send({"type": "http.response.body", "body": frame, "more_body": True})


async def until_done_or_gone(work: Awaitable[Any], receive: Any) -> tuple[bool, Any]:
    """Run `work` while watching the client: (True, result) or (False, None) if the client left."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watch.cancel()
    if task.done() and not task.cancelled():
        return True, task.result()
    return False, None


class Clock:
    """Time since the request arrived, for the time-to-first-byte histogram."""

    def __init__(self, metrics: GatewayMetrics, route: str) -> None:
        self.t0 = time.perf_counter()
        self.metrics = metrics
        self.route = route

    def first_byte(self) -> None:
        self.metrics.ttfb.labels(self.route).observe(time.perf_counter() - self.t0)
