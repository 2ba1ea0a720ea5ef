"""AsyncClient: submit generation requests through Redis and stream the tokens back (asyncio).

All protocol decisions live in `producer_sdk._core` and `._stream`; this module only runs the Redis
calls.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, TypeVar

import redis.asyncio as aioredis

from producer_sdk import _core, _plans
from producer_sdk._client_base import ClientBase, HandleState, ServedModel
from producer_sdk._mux import StreamMux
from producer_sdk._stream import Follower, outcome
from producer_sdk._submit_batch import SubmitBatcher
from producer_sdk.batch import DEFAULT_WINDOW, BatchItem, BatchRun
from producer_sdk.contract import keys, scripts, steps
from producer_sdk.contract.cluster import is_cluster
from producer_sdk.contract.redis_errors import RETRY_CANDIDATES, is_transient
from producer_sdk.errors import QueueFull, RateLimited, RequestFailed, RequestTimeout
from producer_sdk.prepared import EnqueueResult, Prepared
from producer_sdk.results import Chunk, Completion, QueueStats
from producer_sdk.submit_options import GenerateOptions, SubmitOptions, split_wait

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11

T = TypeVar("T")


class Handle(HandleState):
    """One submitted request. Read it with `stream()` (chunks) or `result()` (the Completion).

    Each `stream()` call is an independent reader from the first event, so a request can be read
    twice, or by two handles (even in two processes). After a reader has seen the final event,
    `finish_reason`, `usage`, `timings` and `stop_reason` are filled in.
    """

    def __init__(self, client: AsyncClient, request_id: str, **kwargs: Any) -> None:
        super().__init__(request_id, model=client.model, **kwargs)
        self._client = client

    async def stream(
        self, timeout: float | None = None, *, partial_ok: bool = False, cancel_on_timeout: bool = False
    ) -> AsyncIterator[Chunk]:
        """Yield the chunks of the request as they arrive.

        Raises at the end `Cancelled` / `DeadlineExceeded` (unless `partial_ok`), `RequestFailed`
        on an Error event, `RequestTimeout` after `timeout` seconds in all (cancelling the request
        only if `cancel_on_timeout`). A dropped connection is resumed from the last event seen.
        """
        f = self._follower(self._client._opts, timeout)
        try:
            async with aclosing(self._events(f)) as events:
                async for chunk in events:
                    yield chunk
        except RequestTimeout as e:
            raise await self._timed_out(e, cancel_on_timeout) from None
        except RequestFailed as e:
            self._record_failure(e)
            raise
        self._record(f)
        outcome(f.completion(), partial_ok=partial_ok)

    async def result(
        self, timeout: float | None = None, *, partial_ok: bool = False, cancel_on_timeout: bool = False
    ) -> Completion:
        """Wait for the whole Completion (same errors as `stream`)."""
        cached = self._cached(partial_ok)
        if cached is not None:
            return cached
        async for _ in self.stream(timeout, partial_ok=partial_ok, cancel_on_timeout=cancel_on_timeout):
            pass
        assert self._completion is not None
        return self._completion

    async def cancel(self) -> None:
        """Ask the workers to stop this request; its reader then sees finish_reason "abort"."""
        await self._client.cancel(self.request_id)

    async def _timed_out(self, e: RequestTimeout, cancel: bool) -> RequestTimeout:
        if not cancel:
            return e
        await self._client.cancel(self.request_id)
        return RequestTimeout(self.request_id, e.timeout, cancelled=True)

    async def _events(self, f: Follower) -> AsyncIterator[Chunk]:
        async for batch in self._batches(f):
            for chunk in batch:
                yield chunk

    async def _batches(self, f: Follower) -> AsyncIterator[Iterator[Chunk]]:
        """The chunks of each XREAD reply (possibly none), until `f` is done; liveness checks,
        resubmits and transient errors handled on the way. Each batch is lazy: consume it before the
        next one, and a reader sees the chunks before a divergence that the reply then reveals."""
        r = self._client._redis
        while not f.done:
            try:
                if f.needs_check:
                    if f.on_liveness(*await _plans.run_async(_plans.liveness(f), r)) == Follower.RESUBMIT:
                        f.on_resubmitted(await self._resubmit())
                    continue
                streams, count, block = f.xread_args()
                reply = await self._client._xread(streams, count, block)
            except RETRY_CANDIDATES as e:
                await asyncio.sleep(f.on_error(e))
                continue
            yield f.on_reply(reply)

    async def _resubmit(self) -> EnqueueResult:
        assert self.prepared is not None
        try:
            return await self._client._enqueue(self.prepared)
        except (QueueFull, RateLimited) as e:
            raise _core.lost_on_resubmit(self.request_id, e) from e


class AsyncClient(ClientBase):
    """Producer client of one model namespace (`pagedq:{model}:*`), for asyncio.

    ``AsyncClient(redis_url="redis://localhost:6379/0", model="default", *, tenant=None, max_queue_len=None,
    result_ttl_s=3600, connect_timeout=5.0, block_ms=2000, reconnect_attempts=10,
    reconnect_backoff_max_s=2.0, resubmit_lost=True, limits=DEFAULT_LIMITS, propagate_trace=True,
    **redis_options)``

    `redis_url` is a URL (``redis://[user:password@]host:port/db``, ``rediss://...`` for TLS,
    ``unix://...``, or ``redis+sentinel://[user:password@]host:26379,host2:26379/service_name/db``
    for the primary a Sentinel group names) or an existing ``redis.asyncio.Redis`` (not closed by
    `close()`; it must keep ``decode_responses=False``). `redis_options` go to ``Redis.from_url``
    (through Sentinel: to the primary's connections): ``ssl_ca_certs=``, ``ssl_certfile=``,
    ``ssl_keyfile=``, ``username=``, ``password=``, ...

    `tenant`: the tenant of every request that names none (default "default"): quotas set with
    `pagedq tenant set` apply per tenant (see docs/tenants.md).
    `max_queue_len` caps each priority lane (default: the limit the workers publish in
    ``pagedq:{model}:config``, else none). `result_ttl_s`: how long an answer stays in Redis after
    its request finished, its idempotency marker with it (docs/sdk.md, "How long an answer can be
    fetched"). `block_ms`: the XREAD BLOCK slice (after each idle slice the reader checks
    the request still exists). A failed Redis call is retried `reconnect_attempts` times in a row
    with exponential backoff (full jitter, up to `reconnect_backoff_max_s`), then `ConnectionLost`
    is raised. `resubmit_lost`: when Redis lost a request (a restart without persistence) before
    any token came back, a reader submits it again transparently. `propagate_trace`: a request
    submitted while an OpenTelemetry span is current carries that span's W3C trace context (unless
    it names its own `traceparent`), so the worker's spans join the caller's trace.
    """

    _redis_class = aioredis.Redis
    _asyncio = True
    _handle_class = Handle
    _mux: StreamMux | None = None
    _batcher: SubmitBatcher | None = None

    def _reader(self) -> StreamMux | None:
        """The one XREAD that the client's readers share (producer_sdk._mux); None on a cluster."""
        if is_cluster(self._redis):
            return None
        loop = asyncio.get_running_loop()
        if self._mux is None or self._mux.loop is not loop:
            self._mux = StreamMux(self._redis, keys.reader_wake(self.model, uuid.uuid4().hex), loop)
        return self._mux if self._mux.usable else None

    async def _xread(self, streams: dict, count: int, block: int) -> Any:
        mux = self._reader()
        if mux is None or len(streams) != 1 or mux.reading(next(iter(streams))):
            return await self._redis.xread(streams, count=count, block=block)
        ((key, last_id),) = streams.items()
        return await mux.read(key, last_id, count, block)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        mux, self._mux = self._mux, None  # (a reader retrying after close reads through a new one)
        if mux is not None:
            await mux.close()
        if self._owns_redis:
            await self._redis.aclose()

    async def ping(self) -> bool:
        """Check the connection and the credentials (raises AuthenticationFailed, ConnectionLost)."""
        return bool(await self._retry(self._redis.ping))

    # -- submitting --------------------------------------------------------------------------------

    async def submit(self, prompt: str | None = None, **options: Unpack[SubmitOptions]) -> Handle:
        """Enqueue a request and return its Handle at once.

        Exactly one of `prompt`, `prompt_token_ids`, `messages` (chat, OpenAI's message shape:
        ``{"role", "content"}``, plus ``tool_calls`` / ``tool_call_id`` for tool turns). With
        messages, `tools` (OpenAI's function tools, rendered by the chat template) and `tool_choice`
        ("none", "auto", "required" or ``{"type": "function", "function": {"name": ...}}``; a forced
        call is grammar-constrained; `parallel_tool_calls=False` makes a forced "required" one call).
        `response_format` (OpenAI's: ``{"type": "json_object"}`` or ``{"type": "json_schema",
        "json_schema": {"name", "schema"}}``) constrains the output, as does the sampling parameter
        `structured_outputs` (vLLM's: json, regex, choice, grammar).
        `priority` in [-100, 100] (> 0 high lane, < 0 low lane; the engine schedules higher
        first). `deadline`: seconds from now, a timedelta or a datetime. `**sampling`:
        SamplingParams fields (n, max_tokens, temperature, top_p, top_k, stop, seed, logprobs...).
        Resubmitting an id already submitted (within `result_ttl_s`) adds nothing: the handle
        follows the existing request (`handle.duplicate` is True). `traceparent` / `tracestate`: a
        W3C Trace Context for the worker's spans (default: the current OpenTelemetry span's).
        `tenant`: the tenant this request counts under (default: the client's).
        Raises ValidationError (nothing sent), QueueFull, RateLimited (the tenant is over its quota;
        `retry_after` seconds), AuthenticationFailed, ConnectionLost.
        """
        p = self._prepare(prompt, dict(options))
        return self._new_handle(p, await self._enqueue(p))

    async def submit_many(self, items: Iterable[str | Mapping[str, Any]], **common: Any) -> list[Handle]:
        """Submit many requests in one pipeline. Items are prompt strings or dicts of `submit`
        arguments; `common` arguments apply to every item. All are validated before any is sent.
        A full lane raises QueueFull (a tenant over its quota RateLimited) after the others went
        through (`.handles` has them).
        """
        prepared = self._prepare_many(items, common)
        if prepared:
            await self._check_model()

        async def run() -> list[Any]:
            quotas = await self._quotas({p.tenant for p in prepared})
            return await steps.run_many(self._redis, [self._enqueue_call(p, quotas) for p in prepared])

        return self._many_handles(prepared, await self._retry(run) if prepared else [])

    async def generate(self, prompt: str | None = None, **options: Unpack[GenerateOptions]) -> Completion:
        """Submit and wait for the Completion (`submit` arguments + those of `Handle.result`)."""
        wait = split_wait(options)
        handle = await self.submit(prompt, **options)
        return await handle.result(**wait)

    async def stream(self, prompt: str | None = None, **options: Unpack[GenerateOptions]) -> AsyncIterator[Chunk]:
        """Submit and yield chunks: ``async for chunk in client.stream("Hi", max_tokens=32)``.

        Leaving the loop early (``break``, closing the iterator) cancels the request: nobody else
        holds its handle. Use `submit` + `Handle.stream` to keep it running.
        """
        wait = split_wait(options)
        handle = await self.submit(prompt, **options)
        try:
            async with aclosing(handle.stream(**wait)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except GeneratorExit:
            if not handle.done:
                await self.cancel(handle.request_id)
            raise

    def run_batch(self, items: Iterable[BatchItem | tuple], *, batch_id: str, window: int = DEFAULT_WINDOW) -> BatchRun:
        """Run a batch on the low lane: ``async for custom_id, outcome in client.run_batch(items,
        batch_id="nightly-1")``. `items` are `BatchItem(custom_id, submit_kwargs)` (or such pairs);
        each is submitted with priority -1 under a request id derived from `batch_id` and its index,
        at most `window` in flight; `outcome` is its Completion or its error (never raised). Running
        the same items under the same `batch_id` again attaches to the requests already submitted
        instead of running them twice (see `producer_sdk.batch`)."""
        return BatchRun(self, items, batch_id, window)

    # -- control and stats -------------------------------------------------------------------------

    async def cancel(self, request_id: str) -> None:
        """Set the cancel flag and notify the workers; the request ends with finish_reason abort."""
        await self._run(lambda: _plans.cancel(self.model, request_id, self._opts.result_ttl_s), request_id)

    async def queue_stats(self) -> QueueStats:
        """Queue length per lane, dead letters, and the live workers with their load."""
        return await self._run(lambda: _plans.queue_stats(self.model))

    # -- internals ---------------------------------------------------------------------------------

    async def served_models(self) -> list[ServedModel]:
        """The model names workers serve here (from their heartbeats), with when each was last seen."""
        return self._models.update(await self._run(_plans.served_models))

    async def _check_model(self) -> None:
        if self._opts.check_model and not self._models.fresh(self.model):
            await self.served_models()
            self._models.check(self.model)

    async def _enqueue(self, p: Prepared) -> EnqueueResult:
        """Enqueue `p` with the other submits of this event-loop pass (producer_sdk._submit_batch)."""
        loop = asyncio.get_running_loop()
        if self._batcher is None or self._batcher.loop is not loop:
            self._batcher = SubmitBatcher(self._send_enqueues, loop)
        return await self._batcher.enqueue(p)

    async def _send_enqueues(self, batch: list[Prepared]) -> list[Any]:
        """One pipeline of enqueues; a request whose reply is a transient error is sent again (with
        backoff, as a lone submit would be), the others keep their replies."""
        await self._check_model()
        replies: list[Any] = [None] * len(batch)
        todo = list(range(len(batch)))

        async def run() -> list[Any]:
            nonlocal todo
            quotas = await self._quotas({batch[i].tenant for i in todo})
            sent = await steps.run_many(self._redis, [self._enqueue_call(batch[i], quotas) for i in todo])
            for i, reply in zip(todo, sent, strict=True):
                replies[i] = reply
            todo = [i for i in todo if isinstance(replies[i], Exception) and is_transient(replies[i])]
            if todo:
                raise replies[todo[0]]
            return replies

        return await self._retry(run, batch[0].request_id)

    async def _quotas(self, tenants: set[str]) -> dict[str, scripts.Quota]:
        return await _plans.run_async(_plans.quotas(tenants), self._redis)

    async def _run(self, plan: Callable[[], _plans.Plan[T]], request_id: str | None = None) -> T:
        """Run a plan (`producer_sdk._plans`), afresh after each connection error."""
        return await self._retry(lambda: _plans.run_async(plan(), self._redis), request_id)

    async def _retry(self, op: Callable[[], Awaitable[T]], request_id: str | None = None) -> T:
        """Run `op`, retrying on connection errors (every operation here is idempotent)."""
        backoff = self._opts.backoff()
        while True:
            try:
                return await op()
            except RETRY_CANDIDATES as e:
                await asyncio.sleep(backoff.delay(e, request_id))


__all__ = ["AsyncClient", "Chunk", "Completion", "Handle", "QueueStats"]
