"""Batches: many requests on the low lane, each under a request id derived from the batch id and
the item's index, with a bounded number in flight, their outcomes yielded as they finish.

Deterministic request ids make a batch resumable: running the same items again under the same
`batch_id` (after the producer crashed, say) submits each item under the id it had, so an item that
is queued, running or finished (within the client's `result_ttl_s`) is attached to, not run again.

This module knows nothing of OpenAI's shapes: an item is a custom id and the keyword arguments of
`AsyncClient.submit`. The gateway's /v1/batches and `pagedq batch run` build on it.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

from producer_sdk.constants import REQUEST_ID_PATTERN
from producer_sdk.errors import PagedqError, QueueFull, RateLimited, RequestFailed
from producer_sdk.results import Completion

LOW_PRIORITY = -1  # the low lane (producer_sdk.contract.keys.lane_for_priority)
DEFAULT_WINDOW = 64  # requests of one batch in flight at once
QUEUE_FULL_BACKOFF_S = 1.0  # a full low lane: wait this long before submitting the item again

Outcome = Completion | PagedqError


class BatchItem(NamedTuple):
    """One request of a batch: its custom id (unique in the batch), the keyword arguments of
    `submit` (`prompt` or `messages`, sampling, `tenant`, ...), and its index in the batch (default:
    its position among the items; give it when running a subset, so each keeps its request id)."""

    custom_id: str
    submit: Mapping[str, Any]
    index: int | None = None


def batch_request_id(batch_id: str, index: int) -> str:
    """The request id of item `index` of batch `batch_id`: ``<batch_id>-<index>`` when that is a
    valid request id, else a digest of both."""
    rid = f"{batch_id}-{index}"
    if REQUEST_ID_PATTERN.fullmatch(rid):
        return rid
    return "b-" + hashlib.sha256(f"{batch_id}\x00{index}".encode()).hexdigest()[:40]


def _items(items: Iterable[BatchItem | tuple]) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """(custom id, index, submit arguments on the low lane) of each item; a custom id seen twice
    raises ValueError."""
    seen: set[str] = set()
    for position, raw in enumerate(items):
        item = BatchItem(*raw)
        if item.custom_id in seen:
            raise ValueError(f"custom_id {item.custom_id!r} appears twice in the batch")
        seen.add(item.custom_id)
        submit = dict(item.submit)
        if "request_id" in submit:
            raise ValueError("a batch item cannot name its request_id: the batch derives it")
        priority = submit.get("priority")
        submit["priority"] = priority if isinstance(priority, int) and priority < 0 else LOW_PRIORITY
        yield item.custom_id, position if item.index is None else item.index, submit


def _check(batch_id: str, window: int) -> None:
    if not isinstance(batch_id, str) or not batch_id:
        raise ValueError("batch_id must be a non-empty string")
    if window < 1:
        raise ValueError("window must be at least 1")


class BatchRun:
    """An async iterable of ``(custom_id, Completion | PagedqError)``, one per item, as they finish.

    An item's error is yielded, never raised: a ValidationError (nothing sent), `RequestFailed`,
    `DeadlineExceeded`, `Cancelled`... A full lane or a tenant over its quota is waited out and the
    item submitted again. `cancel()` stops submitting and cancels the requests in flight; they are
    then yielded with their `Cancelled` error (or their Completion, when they finished first); items
    never submitted are not yielded. Leaving the loop early neither cancels nor waits: the requests
    in flight go on, and running the batch again attaches to them.
    """

    def __init__(self, client: Any, items: Iterable[BatchItem | tuple], batch_id: str, window: int) -> None:
        _check(batch_id, window)
        self._client, self._items, self.batch_id, self.window = client, items, batch_id, window
        self.cancelled = False
        self._in_flight: set[str] = set()

    async def cancel(self) -> None:
        self.cancelled = True
        for rid in list(self._in_flight):
            await self._client.cancel(rid)

    def __aiter__(self) -> AsyncIterator[tuple[str, Outcome]]:
        return self._run()

    async def _run(self) -> AsyncIterator[tuple[str, Outcome]]:
        finished: asyncio.Queue[tuple[str, Outcome | None]] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()
        pending = 0
        try:
            for custom_id, index, submit in _items(self._items):
                while pending >= self.window:
                    pending -= 1
                    cid, outcome = await finished.get()
                    if outcome is not None:
                        yield cid, outcome
                if self.cancelled:
                    break
                rid = batch_request_id(self.batch_id, index)
                task = asyncio.create_task(self._one(custom_id, rid, submit, finished))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                pending += 1
            while pending:
                pending -= 1
                cid, outcome = await finished.get()
                if outcome is not None:
                    yield cid, outcome
        finally:
            for task in list(tasks):
                task.cancel()

    async def _one(self, custom_id: str, rid: str, submit: dict[str, Any], finished: asyncio.Queue) -> None:
        outcome: Outcome | None = None
        try:
            handle = await self._submit(rid, submit)
            if handle is not None:
                try:
                    outcome = await handle.result()
                finally:
                    self._in_flight.discard(rid)
        except PagedqError as e:
            outcome = e
        except asyncio.CancelledError:
            raise
        except Exception as e:  # anything else (a Redis error the SDK does not retry) fails this line only
            outcome = RequestFailed("client_error", f"{type(e).__name__}: {e}", request_id=rid)
        finished.put_nowait((custom_id, outcome))

    async def _submit(self, rid: str, submit: dict[str, Any]) -> Any:
        while not self.cancelled:
            self._in_flight.add(rid)
            try:
                return await self._client.submit(request_id=rid, **submit)
            except RateLimited as e:
                self._in_flight.discard(rid)
                await asyncio.sleep(max(e.retry_after, 0.05))
            except QueueFull:
                self._in_flight.discard(rid)
                await asyncio.sleep(QUEUE_FULL_BACKOFF_S)
            except BaseException:
                self._in_flight.discard(rid)
                raise
        return None


def run_batch_sync(
    client: Any, items: Iterable[BatchItem | tuple], batch_id: str, window: int
) -> Iterator[tuple[str, Outcome]]:
    """`Client.run_batch`: the same, blocking; outcomes come in submission order (a window of
    `window` requests in flight, the oldest waited for first)."""
    _check(batch_id, window)
    waiting: deque[tuple[str, Any]] = deque()

    def submit(rid: str, kwargs: dict[str, Any]) -> Any:
        while True:
            try:
                return client.submit(request_id=rid, **kwargs)
            except RateLimited as e:
                time.sleep(max(e.retry_after, 0.05))
            except QueueFull:
                time.sleep(QUEUE_FULL_BACKOFF_S)

    def oldest() -> tuple[str, Outcome]:
        custom_id, handle = waiting.popleft()
        if isinstance(handle, PagedqError):
            return custom_id, handle
        try:
            return custom_id, handle.result()
        except PagedqError as e:
            return custom_id, e

    for custom_id, index, kwargs in _items(items):
        while len(waiting) >= window:
            yield oldest()
        try:
            waiting.append((custom_id, submit(batch_request_id(batch_id, index), kwargs)))
        except PagedqError as e:
            waiting.append((custom_id, e))
    while waiting:
        yield oldest()


__all__ = ["DEFAULT_WINDOW", "LOW_PRIORITY", "BatchItem", "BatchRun", "batch_request_id", "run_batch_sync"]
