"""An AsyncClient's concurrent submits, sent to Redis as one pipeline.

Each `submit` queues its request here; the first of an event-loop pass schedules the flush
(`call_soon`), so the submits made in the same pass (an `asyncio.gather` of them, a burst of
producer coroutines) reach Redis in one round trip on one connection, and a worker's intake reads
them as one burst that joins the engine in one step. Each submit still gets its own answer: its
entry id, or its own QueueFull, RateLimited or duplicate.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from producer_sdk._core import read_enqueue_reply
from producer_sdk.errors import ConnectionLost
from producer_sdk.prepared import EnqueueResult, Prepared

Send = Callable[[list[Prepared]], Awaitable[list[Any]]]


class SubmitBatcher:
    """Collects the submits of one event-loop pass; `send` enqueues a batch and returns one raw
    reply (or the exception Redis answered) per request."""

    def __init__(self, send: Send, loop: asyncio.AbstractEventLoop) -> None:
        self._send = send
        self.loop = loop
        self._pending: list[tuple[Prepared, asyncio.Future[EnqueueResult]]] = []
        self._sending: set[asyncio.Task[None]] = set()  # (a task nobody holds may be collected mid-way)

    def enqueue(self, p: Prepared) -> asyncio.Future[EnqueueResult]:
        """The future of `p`'s enqueue; cancelling it before its batch is sent drops `p`."""
        future: asyncio.Future[EnqueueResult] = self.loop.create_future()
        if not self._pending:
            self.loop.call_soon(self._flush)
        self._pending.append((p, future))
        return future

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        task = self.loop.create_task(self._run(batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _run(self, batch: list[tuple[Prepared, asyncio.Future[EnqueueResult]]]) -> None:
        batch = [(p, f) for p, f in batch if not f.done()]  # (submits cancelled while they waited)
        if not batch:
            return
        try:
            replies = await self._send([p for p, _ in batch])
        except asyncio.CancelledError:
            for _, f in batch:
                f.cancel()
            raise
        except Exception as e:
            for p, f in batch:
                if not f.done():
                    f.set_exception(_for_request(e, p.request_id))
            return
        for (p, f), reply in zip(batch, replies, strict=True):
            if f.done():
                continue
            try:
                f.set_result(read_enqueue_reply(reply, p))
            except Exception as e:
                f.set_exception(e)


def _for_request(exc: Exception, request_id: str) -> Exception:
    """The batch's failure as one submit sees it: a ConnectionLost names that submit's request."""
    if not isinstance(exc, ConnectionLost):
        return exc
    lost = ConnectionLost(str(exc), attempts=exc.attempts, request_id=request_id)
    lost.__cause__ = exc.__cause__
    return lost
