"""Reading a request's response stream into SSE frames, and the ASGI responses that send them while
watching for the client to go away.

The reader is the SDK's own (`Follower`: resume from the last Redis id, duplicates dropped by seq,
liveness checks), driven here so that every XREAD reply becomes one write to the socket.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from gateway import errors
from gateway.metrics import GatewayMetrics
from gateway.render import DONE, Renderer, error_frame
from producer_sdk._stream import Follower
from producer_sdk.client import Handle
from producer_sdk.errors import PagedqError
from producer_sdk.results import Chunk, Completion

log = logging.getLogger("pagedq.gateway")


class Reading:
    """One reader of one request: yields the chunks of each XREAD reply as a batch; afterwards
    `completion` and `final_seq` (the seq of the Finished event) are known."""

    def __init__(self, handle: Handle, timeout: float | None = None) -> None:
        self.handle = handle
        self.follower: Follower = handle._follower(handle._client._opts, timeout)
        self.completion: Completion | None = None
        self.final_seq = -1

    async def batches(self) -> AsyncIterator[list[Chunk]]:
        f = self.follower
        async for chunks in self.handle._batches(f):
            batch = list(chunks)
            if batch:
                yield batch
        self.completion = f.completion()
        self.final_seq = f.expected_seq - 1

    async def result(self) -> Completion:
        async for _ in self.batches():
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
        async for batch in reading.batches():
            frames = b"".join(renderer.token_frame(c) for c in batch if c.seq > after)
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
    `on_disconnect` runs (it cancels the request unless the client asked to resume later)."""

    def __init__(
        self,
        body: AsyncIterator[bytes],
        *,
        metrics: GatewayMetrics,
        on_disconnect: Callable[[], Awaitable[None]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.body = body
        self.metrics = metrics
        self.on_disconnect = on_disconnect
        self.headers = SSE_HEADERS + [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
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
