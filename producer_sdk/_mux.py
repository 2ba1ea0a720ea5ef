"""One blocking XREAD for all the response streams an AsyncClient is reading (one node or Sentinel).

Each reader used to hold its own `XREAD BLOCK` on its own pooled connection: 64 requests streamed
at once meant 64 connections and, per engine step, 64 round trips that each carried one entry. Here
the readers of a client register (stream key, last id seen) and one task reads them all with one
`XREAD BLOCK` over every registered key; each reader gets the part of the reply for its stream, in
the shape of a one-stream XREAD reply, so `Follower.on_reply` reads it as before.

A reader that registers while that XREAD is blocked would otherwise wait for the slice to end: the
client then adds an entry to its own wake stream (`keys.reader_wake`), which the XREAD also reads,
so it returns at once and the next round includes the new stream. The wake stream holds one entry
and expires a minute after the last wake, or when the client closes.

Not used on Redis Cluster: request streams live in different hash slots, and one XREAD reads one.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from dataclasses import dataclass, field
from typing import Any

import redis.exceptions

from producer_sdk.contract.redis_errors import RETRY_CANDIDATES

WAKE_TTL_MS = 60_000
CLOSE_WAIT_S = 1.0


@dataclass(slots=True, eq=False)
class _Waiter:
    key: bytes
    last_id: Any
    count: int
    until: float  # monotonic time at which its block slice ends
    future: asyncio.Future = field(repr=False)
    polled: bool = False  # an XREAD that included its stream has returned (only then may it time out)


class StreamMux:
    """Reads many response streams with one XREAD at a time (see the module docstring)."""

    def __init__(self, redis: Any, wake_key: str, loop: asyncio.AbstractEventLoop) -> None:
        self._redis = redis
        self.loop = loop  # the event loop it reads on (a client used from another loop gets another)
        self.usable = True  # False once the server refused the wake stream: each reader reads alone
        self._wake_key = wake_key.encode()
        self._wake_id: Any = b"0-0"
        self._waiters: dict[bytes, _Waiter] = {}
        self._task: asyncio.Task | None = None
        self._wake_task: asyncio.Task | None = None
        self._blocked = False  # an XREAD is in flight
        self._woken = False  # a wake was sent for the XREAD in flight
        self.rounds = 0  # XREADs issued
        self.wakes = 0  # wake entries written

    def reading(self, key: str) -> bool:
        """Whether a reader of `key` is registered already (a second one reads on its own)."""
        return key.encode() in self._waiters

    async def read(self, key: str, last_id: Any, count: int, block_ms: int) -> Any:
        """What `XREAD COUNT count BLOCK block_ms STREAMS key last_id` returns: the entries after
        `last_id` (as `[[key, entries]]`), or an empty list once `block_ms` passed without any."""
        loop = asyncio.get_running_loop()
        w = _Waiter(key.encode(), last_id, count, time.monotonic() + block_ms / 1000, loop.create_future())
        self._waiters[w.key] = w
        if self._task is None or self._task.done():
            # in a fresh context: the shared task is no reader's (not the first one's trace span)
            self._task = contextvars.Context().run(loop.create_task, self._run())
        elif self._blocked and not self._woken:
            self._woken = True
            self._wake_task = contextvars.Context().run(loop.create_task, self._wake())
        try:
            return await w.future
        finally:
            if self._waiters.get(w.key) is w:
                del self._waiters[w.key]

    async def close(self) -> None:
        """Stop reading: registered readers get a ConnectionError (they retry, as after a dropped
        connection), the XREAD in flight is woken so that its connection comes back to the pool,
        and the wake stream expires."""
        self._fail(list(self._waiters.values()), redis.exceptions.ConnectionError("the client was closed"))
        task = self._task
        if task is not None and not task.done():
            if self._blocked:
                await self._wake()
            try:  # it returns at the wake; cancelling a blocked redis-py call was not always prompt
                await asyncio.wait_for(asyncio.shield(task), CLOSE_WAIT_S)
            except (asyncio.TimeoutError, *RETRY_CANDIDATES):
                task.cancel()
        if self.wakes:
            with contextlib.suppress(*RETRY_CANDIDATES):  # else it expires on its own
                await self._redis.pexpire(self._wake_key, 1)  # (PEXPIRE: the producer ACL has no DEL)

    async def _run(self) -> None:
        try:
            await self._rounds()
        except BaseException as e:  # cancelled, or a bug: no reader may wait on a read that has stopped
            lost = e if isinstance(e, Exception) else redis.exceptions.ConnectionError("the shared read stopped")
            self._fail(list(self._waiters.values()), lost)
            raise

    async def _rounds(self) -> None:
        while self._waiters:
            now = time.monotonic()
            for w in [w for w in self._waiters.values() if w.polled and w.until <= now]:
                self._resolve(w, [])  # its slice passed without an entry
            if not self._waiters:
                return
            batch = dict(self._waiters)
            streams = {k: w.last_id for k, w in batch.items()}
            streams[self._wake_key] = self._wake_id
            block = max(1, int((min(w.until for w in batch.values()) - now) * 1000))
            count = max(w.count for w in batch.values())
            self._blocked, self._woken, refused = True, False, False
            try:
                reply = await self._redis.xread(streams, count=count, block=block)
            except redis.exceptions.ResponseError:
                refused = True  # one bad key (say a WRONGTYPE) must fail its reader only
            except Exception as e:  # each reader decides: retry, give up, or raise
                self._fail(list(batch.values()), e)
                continue
            finally:
                self._blocked = False
            if _cancel_was_swallowed():
                raise asyncio.CancelledError  # (redis-py 8 can lose one that lands while it sends)
            if refused:
                await self._one_by_one(batch, count)
                continue
            self.rounds += 1
            for w in batch.values():
                w.polled = True
            self._dispatch(reply, batch)
            # Let the readers just answered take their entries and register again, so that the next
            # XREAD includes them (rather than a wake for each).
            await asyncio.sleep(0)

    async def _one_by_one(self, batch: dict[bytes, _Waiter], count: int) -> None:
        """After the shared XREAD was refused: read each stream on its own, without blocking, so that
        the reader whose key the server refused gets that error and the others their entries. If no
        reader's key was refused (the wake stream was, say by an ACL), stop sharing: each reader is
        answered now and reads alone from then on."""
        pipe = self._redis.pipeline(transaction=False)
        for key, w in batch.items():
            pipe.xread({key: w.last_id}, count=count)
        try:
            replies = await pipe.execute(raise_on_error=False)
        except Exception as e:
            self._fail(list(batch.values()), e)
            return
        refused = False
        for (key, w), reply in zip(batch.items(), replies, strict=True):
            w.polled = True
            if self._waiters.get(key) is not w:
                continue
            if isinstance(reply, Exception):
                refused = True
                self._fail([w], reply)
            elif reply:
                self._dispatch(reply, {key: w})
        if not refused:
            self._stop_sharing()

    def _stop_sharing(self) -> None:
        self.usable = False
        for w in list(self._waiters.values()):
            self._resolve(w, [])  # (an idle slice to its reader: it checks liveness, then reads alone)

    def _dispatch(self, reply: Any, batch: dict[bytes, _Waiter]) -> None:
        if not reply:
            return
        items = reply.items() if isinstance(reply, dict) else reply
        for key, value in items:
            entries = value[0] if isinstance(reply, dict) else value
            key = key if isinstance(key, bytes) else str(key).encode()
            if key == self._wake_key:
                if entries:
                    self._wake_id = entries[-1][0]
                continue
            w = batch.get(key)
            if w is not None and self._waiters.get(key) is w:
                self._resolve(w, [[key, entries]])

    def _resolve(self, w: _Waiter, reply: Any) -> None:
        del self._waiters[w.key]
        if not w.future.done():
            w.future.set_result(reply)

    def _fail(self, waiters: list[_Waiter], exc: BaseException) -> None:
        for w in waiters:
            if self._waiters.get(w.key) is w:
                del self._waiters[w.key]
            if not w.future.done():
                w.future.set_exception(exc)

    async def _wake(self) -> None:
        """Make the XREAD in flight return: it reads the wake stream too."""
        try:
            pipe = self._redis.pipeline(transaction=False)
            pipe.xadd(self._wake_key, {b"w": b"1"}, maxlen=1, approximate=False)
            pipe.pexpire(self._wake_key, WAKE_TTL_MS)
            await pipe.execute()
            self.wakes += 1
        except (redis.exceptions.NoPermissionError, redis.exceptions.ReadOnlyError):
            self.usable = False  # this client may not write its wake stream: from now on each reader reads alone
        except Exception:
            pass  # the XREAD fails too, or its slice ends: either way the new reader is read next round


def _cancel_was_swallowed() -> bool:
    """Whether this task was cancelled and went on running (Python 3.11+ can tell)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return cancelling is not None and cancelling() > 0
